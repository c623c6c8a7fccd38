"""Errors a client sees, as OpenAI-style JSON bodies; the one place prefill's errors become HTTP."""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect

from epd.prefill.errors import (
    BadImage,
    BadRequest,
    Overloaded,
    PrefillError,
    TimedOut,
    Unavailable,
)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, kind="service_unavailable", code="service_unavailable")


def overloaded(message: str, retry_after_s: int = 1) -> APIError:
    """A 503 the client should retry soon: the server is full or shutting down."""
    return APIError(
        503,
        message,
        kind="service_unavailable",
        code="overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def timed_out(message: str) -> APIError:
    return APIError(504, message, kind="timeout", code="timeout")


def internal(message: str) -> APIError:
    return APIError(500, message, kind="server_error", code="internal_error")


def from_prefill(error: PrefillError) -> APIError:
    """The HTTP error for what went wrong in prefill or one of its peers."""
    message = str(error)
    if isinstance(error, BadImage):
        return bad_request(message, code="invalid_image")
    if isinstance(error, BadRequest):
        return bad_request(message)
    if isinstance(error, Overloaded):
        return overloaded(message, error.retry_after_s)
    if isinstance(error, Unavailable):
        return unavailable(message)
    if isinstance(error, TimedOut):
        return timed_out(message)
    return internal(message)


def as_api_error(error: Exception) -> APIError:
    """Any exception as the error a client sees; one not foreseen is a 500 naming it."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, PrefillError):
        return from_prefill(error)
    if isinstance(error, ClientDisconnect):  # it left while sending its body: nobody to tell
        return APIError(499, "the client closed the request", code="client_closed_request")
    return internal(f"{type(error).__name__}: {error}")
