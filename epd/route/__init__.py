"""`epd route`: the OpenAI API in front of several prefills (see `app.py`)."""

import sys


def keep_torch_out() -> None:
    """Mark torch absent in this process, before anything imports transformers. transformers 5
    imports torch with any tokenizer where torch is installed: ~250 MB and seconds, for a
    process that runs no model. Marked absent, it is never imported, and transformers runs its
    tokenizers without it. Called by `epd route` alone: never in a process that runs a model."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
