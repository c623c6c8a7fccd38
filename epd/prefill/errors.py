"""What can go wrong with a request in prefill, in prefill's own words.

The API turns each kind into an HTTP status and an OpenAI error body (`epd.api.errors`); prefill
does not know it serves HTTP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router builds prompts with these errors, and imports no torch
    from epd.wire.messages import Failure


class PrefillError(Exception):
    """A request that prefill, or a peer working on it, could not serve."""


class BadRequest(PrefillError):
    """The request asks for something this deployment does not do (too many images, ...)."""


class BadImage(BadRequest):
    """An image cannot be used: corrupt, too large, an unknown format."""


class Unavailable(PrefillError):
    """A peer the request needs is down, or did not take the request in time."""


class EncoderLost(Unavailable):
    """The encoder holding some of the request's images went (its connection lost): they may be
    encoded again by another (`Encoding.embed`)."""


class DecoderLost(Unavailable):
    """The decoder streaming the request went (its connection lost): the request may move to
    another (`Coordinator.migrate`)."""

    def __init__(self, message: str, decoder: str) -> None:
        super().__init__(message)
        self.decoder = decoder  # which: a loss of one the request has left since is stale


class Overloaded(PrefillError):
    """The request would wait longer than it may: refused before any work, to be retried."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TimedOut(PrefillError):
    """A peer took the request and did not answer in time."""


class Internal(PrefillError):
    """A peer failed on the request, or answered something that cannot be right."""


def from_failure(failure: Failure) -> PrefillError:
    """The error a peer's Failure message stands for."""
    kinds: dict[str, type[PrefillError]] = {
        "bad_image": BadImage,
        "bad_request": BadRequest,
        "unavailable": Unavailable,
    }
    return kinds.get(failure.code, Internal)(failure.message)
