"""Where a request stands, in prefill or in decode: one status for its whole life.

Prefill: ENCODING → WAITING → RUNNING (its forward) → DECODING (handed off) → FINISHED.
Decode: WAITING → RUNNING ⇄ PREEMPTED (sent back to wait for KV blocks) → FINISHED.
A chunked prompt goes back to WAITING between its chunks.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    ENCODING = "encoding"  # its images' embeddings awaited from the encoders
    WAITING = "waiting"  # for a forward: queued, or between two chunks of its prompt
    RUNNING = "running"  # in the forward (prefill's) or the batch (decode's) that runs now
    PREEMPTED = "preempted"  # decode's: its cache moved out of the pool until blocks free up
    DECODING = "decoding"  # prefill's: handed to a decoder, whose tokens it streams
    FINISHED = "finished"  # its last token sent, failed or aborted
