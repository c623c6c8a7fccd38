"""The image work this prefill has sent to encoders and not yet had back, and how fast they get
through it: enough to tell, as a request's images are about to be sent, whether they would be
encoded within `encode_timeout_s`. One that would not is refused at once (503, Retry-After), not
failed a minute later: a burst of large images must not turn into a burst of timeouts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from epd.prefill.errors import Overloaded

# A request is admitted while its images would be back within this share of the time limit:
# the rate is a recent average, and a reply still has to travel and be checked.
ADMIT_SHARE = 0.75
# Each new measurement's weight in the encoders' rate: recent enough to follow a change of
# image sizes or of other prefills' load on a shared encoder, smooth enough not to jump.
DECAY = 0.8


@dataclass
class Sent:
    encoder: str
    patches: int
    at: float


@dataclass
class EncoderPace:
    """One encoder's recent patches per second, from the times its replies came back."""

    patches: float = 0.0  # decayed sums over its replies
    seconds: float = 0.0
    last_reply: float = 0.0

    def replied(self, sent: Sent, now: float) -> None:
        # An encoder answers in turn: a part's time is from when it was sent, or from the
        # encoder's previous reply if that came later (until then it was busy with others).
        busy = now - max(sent.at, self.last_reply)
        self.last_reply = now
        self.patches = DECAY * self.patches + sent.patches
        self.seconds = DECAY * self.seconds + busy

    @property
    def rate(self) -> float:
        return self.patches / self.seconds if self.seconds > 0 else math.inf


@dataclass
class EncodeLoad:
    """Patches sent and not back, by (request id, part), and each encoder's pace."""

    timeout_s: float
    sent: dict[tuple[str, int], Sent] = field(default_factory=dict)
    paces: dict[str, EncoderPace] = field(default_factory=dict)

    @property
    def backlog(self) -> int:
        return sum(s.patches for s in self.sent.values())

    def rate(self) -> float | None:
        """Patches per second over the encoders: each measured one's pace; for one not measured
        yet, the most it can be, from its oldest part out (P patches not back after T seconds:
        at most P / T). None when nothing is known of any."""
        now, rates = time.perf_counter(), {}
        for sent in reversed(self.sent.values()):  # in the order sent: the oldest last, kept
            if sent.encoder not in self.paces:
                rates[sent.encoder] = sent.patches / max(now - sent.at, 1e-9)
        rates |= {encoder: p.rate for encoder, p in self.paces.items() if p.seconds > 0}
        return sum(rates.values()) if rates else None

    def wait_s(self, patches: int) -> float:
        """How long `patches` more would take to come back, behind the backlog (0 when nothing
        is known: a new encoder is trusted until its first part shows its pace)."""
        rate = self.rate()
        return 0.0 if rate is None else (self.backlog + patches) / rate

    def admit(self, patches: int) -> None:
        """Raise Overloaded if `patches` more would not be back in time. With nothing ahead of
        them, they go whatever their size: waiting would not make them faster."""
        wait, limit = self.wait_s(patches), ADMIT_SHARE * self.timeout_s
        if wait <= limit or not self.sent:
            return
        behind = self.backlog
        retry = max(1, math.ceil(wait - limit))
        raise Overloaded(
            f"the encoders have {behind} image patches to get through before this request's "
            f"{patches}, more than they encode within {self.timeout_s:g}s "
            f"(encode_timeout_s); retry in {retry}s",
            retry,
        )

    def sending(self, key: tuple[str, int], encoder: str, patches: int) -> None:
        self.sent[key] = Sent(encoder, patches, time.perf_counter())

    def replied(self, key: tuple[str, int]) -> None:
        """An encoder's embeddings for `key` came: its pace is measured by them."""
        if (sent := self.sent.pop(key, None)) is not None:
            self.paces.setdefault(sent.encoder, EncoderPace()).replied(sent, time.perf_counter())

    def failed(self, request_id: str) -> None:
        """A request's parts that will not come back (a Failure, a lost encoder)."""
        for key in [k for k in self.sent if k[0] == request_id]:
            del self.sent[key]

    def lost(self, encoder: str) -> None:
        for key in [k for k, s in self.sent.items() if s.encoder == encoder]:
            del self.sent[key]
        self.paces.pop(encoder, None)

    def expire(self, older_than_s: float) -> None:
        """Forget parts sent longer ago than any request waits for them: an encoder that
        never answers must not hold the backlog up for ever."""
        cut = time.perf_counter() - older_than_s
        for key in [k for k, s in self.sent.items() if s.at < cut]:
            del self.sent[key]

    def status(self) -> dict[str, object]:
        rate = self.rate()
        return {
            "encode_backlog_patches": self.backlog,
            "encode_patches_per_s": round(rate, 1) if rate is not None else None,
        }
