"""The image work this prefill has sent to encoders and not yet had back, and how fast each
encoder gets through it: enough to tell, before a request's images are sent, whether they would
be back within `encode_timeout_s`, and while they wait, whether they still will be.

One that would not is refused at once (503, Retry-After), and one admitted whose encoder has
slowed since is refused as soon as that shows, not failed at the time limit: a burst of large
images must turn into neither a burst of timeouts nor a late one.

An encoder answers the parts it holds in the order they were sent, so a part is back once what
is ahead of it on its encoder, and itself, are done at that encoder's pace. The pace is the
slowest of three views: the decayed average of its replies, its latest reply alone, and the
part under way (P patches not back after T seconds of its turn: at most P/T a second), so a
machine that slows shows at its next reply, or while the part runs, not replies later. An
encoder not measured yet has no pace: it is given at most one request's images at the
server's limits (`first_patches`), which encode_timeout_s must allow for anyway; once it has
answered, what was admitted on that trust is refused as soon as it would be late. An encoder
with nothing out takes a part whatever its pace: waiting would not make it faster, and its
reply measures it again (a pace from one stalled reply must not refuse it for good). Its
request is still refused while it waits if that pace says it would be late: a 503 at once
is worth more than a 504 at the limit when the pace is right, and when it is stale, the
encoder answers the part all the same and is measured by it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from epd.prefill.errors import Overloaded

# A request is admitted while its images would be back within this share of the time limit:
# the pace is measured on earlier images, and a reply still has to travel and be checked.
ADMIT_SHARE = 0.75
# Each new measurement's weight in an encoder's average pace: smooth enough not to jump at one
# odd reply; a slower one counts at once through the latest reply's own pace.
DECAY = 0.8

Key = tuple[str, int]  # (request id, part)


@dataclass
class Sent:
    encoder: str
    patches: int
    at: float


@dataclass
class EncoderPace:
    """One encoder's patches per second, from the times its replies came back."""

    patches: float = 0.0  # decayed sums over its replies
    seconds: float = 0.0
    last_reply: float = 0.0
    latest: float = math.inf  # the last reply's own patches per second

    def replied(self, sent: Sent, now: float) -> None:
        # An encoder answers in turn: a part's time is from when it was sent, or from the
        # encoder's previous reply if that came later (until then it was busy with others).
        busy = max(now - max(sent.at, self.last_reply), 1e-6)
        self.last_reply = now
        self.patches = DECAY * self.patches + sent.patches
        self.seconds = DECAY * self.seconds + busy
        self.latest = sent.patches / busy

    @property
    def rate(self) -> float:
        return min(self.patches / self.seconds, self.latest)


@dataclass
class EncodeLoad:
    """Patches sent and not back, by (request id, part), and each encoder's pace."""

    timeout_s: float
    first_patches: int = 0  # the most an encoder not measured yet may hold
    sent: dict[Key, Sent] = field(default_factory=dict)  # in the order sent
    paces: dict[str, EncoderPace] = field(default_factory=dict)

    @property
    def backlog(self) -> int:
        return sum(s.patches for s in self.sent.values())

    def outlook(self, encoder: str, now: float) -> tuple[float | None, dict[Key, float]]:
        """`encoder`'s pace now (None before its first reply), and for each part it holds,
        in the order sent, the seconds until it should be back (empty while not measured)."""
        queue = [(key, s) for key, s in self.sent.items() if s.encoder == encoder]
        pace = self.paces.get(encoder)
        if pace is None:
            return None, {}
        if not queue:
            return pace.rate, {}
        oldest = queue[0][1]
        begun = now - max(oldest.at, pace.last_reply)  # the part under way: its turn so far
        rate = min(pace.rate, oldest.patches / begun) if begun > 0 else pace.rate
        back, patches = {}, 0
        for key, sent in queue:
            patches += sent.patches
            back[key] = patches / rate - begun  # ≥ 0: the rate is at most oldest / begun
        return rate, back

    def held(self, encoder: str) -> int:
        """Patches sent to `encoder` and not back."""
        return sum(s.patches for s in self.sent.values() if s.encoder == encoder)

    def wait_s(self, encoder: str, patches: int, now: float) -> float | None:
        """How long `patches` more sent to `encoder` would take to come back: 0 with nothing
        out there (see the module's notes); None when that cannot be promised (an encoder not
        measured yet, past `first_patches`; 0 within them: its time is not known, but no more
        than a lone request's at the limits)."""
        if not (held := self.held(encoder)):
            return 0.0
        rate, back = self.outlook(encoder, now)
        if rate is None:
            return None if held + patches > self.first_patches else 0.0
        return max(back.values(), default=0.0) + patches / rate

    def quickest(self, encoders: Sequence[str], patches: int = 0) -> list[str]:
        """`encoders` by when `patches` more would be back from each, soonest first (then the
        least held; then in the order given, a rotation; one that cannot promise them last):
        the order parts are given in, so that admission judges the encoders a send would use."""
        now = time.perf_counter()

        def soonest(encoder: str) -> tuple[float, int]:
            wait = self.wait_s(encoder, patches, now)
            return math.inf if wait is None else wait, self.held(encoder)

        return sorted(encoders, key=soonest)

    def admit(self, parts: Sequence[tuple[str, int]]) -> None:
        """Raise Overloaded unless every part, (encoder, patches), would be back in time. A
        part for an encoder with nothing out goes whatever its size: waiting would not make it
        faster (with nothing out at all, every part goes)."""
        if not self.sent:
            return
        now = time.perf_counter()
        waits = [
            (self.wait_s(encoder, patches, now), encoder, patches) for encoder, patches in parts
        ]
        if unknown := [(encoder, patches) for wait, encoder, patches in waits if wait is None]:
            encoder, patches = unknown[0]
            raise Overloaded(
                f"an encoder for these images is busy with its first images "
                f"({self.held(encoder)} patches), and its pace is not known until those are "
                f"back: this request's {patches} image patches more could not be promised "
                f"within {self.timeout_s:g}s (encode_timeout_s); retry in 1s",
                1,
            )
        wait, encoder, patches = max((w, e, p) for w, e, p in waits if w is not None)
        if wait > (limit := ADMIT_SHARE * self.timeout_s):
            retry = max(1, math.ceil(wait - limit))
            raise Overloaded(
                f"an encoder for these images has {self.held(encoder)} image patches to get "
                f"through before this request's {patches}, more than it encodes within "
                f"{self.timeout_s:g}s (encode_timeout_s); retry in {retry}s",
                retry,
            )

    def expected_s(self, request_id: str) -> float | None:
        """Seconds until the request's parts still out should all be back (0 when none is);
        None while one is on an encoder not measured yet."""
        now, expected = time.perf_counter(), 0.0
        for encoder in {s.encoder for key, s in self.sent.items() if key[0] == request_id}:
            rate, back = self.outlook(encoder, now)
            if rate is None:
                return None
            expected = max([expected, *(t for key, t in back.items() if key[0] == request_id)])
        return expected

    def check_in_time(self, request_id: str, waited: float) -> None:
        """Raise Overloaded once the request's parts out, after `waited` seconds, would not all
        be back within the time limit at the encoders' pace now."""
        expected = self.expected_s(request_id)
        if expected is None or waited + expected <= self.timeout_s:
            return
        retry = max(1, math.ceil(waited + expected - self.timeout_s))
        raise Overloaded(
            f"the encoders have slowed since this request was admitted: its images would be "
            f"back after {waited + expected:.0f}s, past {self.timeout_s:g}s (encode_timeout_s); "
            f"retry in {retry}s",
            retry,
        )

    def rate(self) -> float | None:
        """Patches per second over the measured encoders (None: none is measured yet)."""
        now = time.perf_counter()
        rates = [self.outlook(encoder, now)[0] for encoder in self.paces]
        return sum(r for r in rates if r is not None) if rates else None

    def sending(self, key: Key, encoder: str, patches: int) -> None:
        self.sent[key] = Sent(encoder, patches, time.perf_counter())

    def replied(self, key: Key) -> None:
        """An encoder's embeddings for `key` came: its pace is measured by them."""
        if (sent := self.sent.pop(key, None)) is not None:
            self.paces.setdefault(sent.encoder, EncoderPace()).replied(sent, time.perf_counter())

    def failed(self, request_id: str, encoder: str | None = None) -> None:
        """A request's parts that will not come back: those that never reached `encoder` (a
        message the outbox gave up on), or on a Failure, all of them. A Failure names the
        request, not the part, so the encoder that sent it cannot be told from those still
        busy with the request's other parts: kept, its part would stay at the head of its
        queue, refusing others until `expire`. Dropped, another encoder's part is missed for
        no longer than it takes, and the time it takes is counted in that encoder's next
        reply (measured from its previous one): its pace errs slow, not fast."""
        for key in [k for k, s in self.sent.items() if k[0] == request_id]:
            if encoder in (None, self.sent[key].encoder):
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
