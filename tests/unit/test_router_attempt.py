"""What the router makes of a decode's answer before anything reached the client (`router/attempt.py`): the
status a refusal carries, also when it is the first event of a stream whose 200 went first."""

from __future__ import annotations

import json

import pytest

from disagg_worker.request.errors import APIError, internal_error, too_many_requests, unavailable
from disagg_worker.router.attempt import error_in


def first_event(e: APIError) -> bytes:
    return f"data: {json.dumps(e.body())}\n\n".encode()


@pytest.mark.parametrize(
    "error,status,retryable",
    [
        (unavailable("the decode prealloc queue is full; retry later"), 503, True),
        (too_many_requests(8), 429, True),
        (APIError(400, "max_tokens: too large", param="max_tokens"), 400, False),
        (APIError(500, "KV transfer failed", "server_error"), 500, True),
        (internal_error("abc"), 500, False),
    ],
)
def test_a_streams_error_event_is_answered_with_the_status_it_names(error, status, retryable):
    attempt = error_in(200, first_event(error))
    assert attempt is not None and attempt.status == status and attempt.retryable is retryable
    answered = attempt.error()
    assert answered.status == status and answered.message == error.message and answered.code == error.code
    assert (answered.retry_after is not None) == (status in (429, 503))


def test_a_refusal_before_the_stream_keeps_its_status_and_a_started_stream_is_no_error():
    refused = error_in(503, json.dumps(unavailable("draining", code="draining").body()).encode())
    assert refused is not None and refused.status == 503 and refused.code == "draining"
    assert error_in(200, b'data: {"choices": [{"text": "Paris"}]}\n\n') is None
