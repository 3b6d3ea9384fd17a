"""Errors the HTTP API returns, in OpenAI's shape.

Anything raised while parsing or validating a request is an `APIError`; the server turns it into
a response with `status` and `body()` and never needs to know which check failed.
"""

from __future__ import annotations


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    # OpenAI answers an unknown model with 404, type invalid_request_error, code model_not_found.
    message = f"The model `{model}` does not exist."
    return APIError(404, message, "invalid_request_error", "model", "model_not_found")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable")
