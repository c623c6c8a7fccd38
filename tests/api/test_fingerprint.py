"""system_fingerprint: the version and a hash of what shapes the replies, stable for the same."""

import importlib.metadata
import re

import torch

from epd.api.fingerprint import system_fingerprint

CPU = torch.device("cpu")


def test_the_fingerprint_names_the_version_and_changes_with_what_shapes_replies(tmp_path):
    served = system_fingerprint(str(tmp_path), torch.float32, CPU, 4096)
    version = re.escape(importlib.metadata.version("epd"))
    assert re.fullmatch(rf"epd-{version}-[0-9a-f]{{8}}", served)
    assert system_fingerprint(str(tmp_path / "." / ""), torch.float32, CPU, 4096) == served
    others = [
        system_fingerprint(str(tmp_path / "other"), torch.float32, CPU, 4096),
        system_fingerprint(str(tmp_path), torch.bfloat16, CPU, 4096),
        system_fingerprint(str(tmp_path), torch.float32, torch.device("meta"), 4096),
        system_fingerprint(str(tmp_path), torch.float32, CPU, 2048),
    ]
    assert served not in others and len(set(others)) == len(others)
