"""Errors the HTTP API returns, in OpenAI's shape.

Anything raised while parsing or validating a request is an `APIError`; the server turns it into
a response with `status`, `headers()` and `body()` and never needs to know which check failed.
A refusal the client should retry later (429, 503) carries `retry_after` seconds.
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
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

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


# The code of a 503 (the instance cannot take the request now: another may), and of a 429 (OpenAI's): what a
# stream's error event carries where its status cannot (the stream's 200 went first), so that the router knows
# a decode's refusal of a stream it never started.
SERVICE_UNAVAILABLE = "service_unavailable"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
STATUS_OF_CODE = {SERVICE_UNAVAILABLE: 503, RATE_LIMIT_EXCEEDED: 429}
CODE_OF_STATUS = {status: code for code, status in STATUS_OF_CODE.items()}


def unavailable(message: str, retry_after: int | None = None, code: str = SERVICE_UNAVAILABLE) -> APIError:
    return APIError(503, message, "server_error", code=code, retry_after=retry_after)


def too_many_requests(limit: int, retry_after: int = 1) -> APIError:
    # OpenAI answers a rate limit with 429, type "requests", code "rate_limit_exceeded".
    message = f"This server is at its limit of {limit} requests in flight; retry in {retry_after} s."
    return APIError(429, message, "requests", code=RATE_LIMIT_EXCEEDED, retry_after=retry_after)


def too_large(limit: int) -> APIError:
    message = (
        f"The request body is larger than this server accepts ({limit} bytes, from the model's maximum context); "
        "send a shorter prompt."
    )
    return APIError(413, message, "invalid_request_error", code="request_too_large")


# Codes of 500s the router must not retry on another instance: the request failed on its own (a retry would
# fail the same way), or the instance failed while holding it (a retry could fail the next one too).
INTERNAL_ERROR = "internal_error"
INSTANCE_FAILED = "instance_failed"
NOT_RETRIED = frozenset({INTERNAL_ERROR, INSTANCE_FAILED})


def internal_error(ref: str) -> APIError:
    """A bug: the message names where the details are, never the exception itself."""
    message = f"Internal error while handling the request; the server log has the details under id {ref}."
    return APIError(500, message, "server_error", code=INTERNAL_ERROR)
