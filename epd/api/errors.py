"""Errors a client sees, as OpenAI-style JSON bodies."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

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


def timed_out(message: str) -> APIError:
    return APIError(504, message, kind="timeout", code="timeout")


def internal(message: str) -> APIError:
    return APIError(500, message, kind="server_error", code="internal_error")
