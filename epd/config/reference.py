"""The configuration reference in the README, generated from the role dataclasses.

`python -m epd.config.reference` prints it; a test keeps the README's copy identical.
"""

from __future__ import annotations

import dataclasses

from epd.config.roles import ROLES, ModelOptions
from epd.config.sources import SERVE_OWNS, SHARED


def _default(field: dataclasses.Field[object]) -> str:
    if field.default is dataclasses.MISSING:
        return "required"
    value = field.default
    if isinstance(value, tuple):
        value = " ".join(value)
    return f"`{value}`" if value != "" else "—"


def _vllm(field: dataclasses.Field[object]) -> str:
    """The vLLM flag a setting stands for, and its form where that is not epd's."""
    vllm = field.metadata.get("vllm")
    if not vllm:
        return "—"
    return f"`{vllm.name}` ({vllm.form})" if vllm.form else f"`{vllm.name}`"


def _rows(fields: list[dataclasses.Field[object]]) -> list[str]:
    return [
        f"| `{f.name}` | `--{f.name.replace('_', '-')}` | {_vllm(f)} | {_default(f)} "
        f"| {f.metadata['help']} |"
        for f in fields
    ]


def reference() -> str:
    header = ["| key | flag | vLLM flag | default | meaning |", "|---|---|---|---|---|"]
    lines = ["Shared by every role (top level of a config file, or inside a role's section):", ""]
    lines += header + _rows(list(dataclasses.fields(ModelOptions)))
    for role, cls in ROLES.items():
        own = [f for f in dataclasses.fields(cls) if f.name not in SHARED]
        lines += ["", f"`{role}:` (`epd {role}`)", "", *header, *_rows(own)]
    owned = ", ".join(f"`{name}`" for name in sorted(SERVE_OWNS))
    lines += [
        "",
        "`epd serve` also takes every encode, prefill and decode setting above as its own flag",
        f"(given to each role that has it), except the addresses it owns: {owned}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
