"""Generated malformed input against the router (and through it, the workers): never a 5xx for a
client error, always an OpenAI-style JSON error body, and the router keeps serving."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.test_pd import stack  # noqa: F401 - the module's P/D stack fixture
from tests.timing import scaled

pytestmark = pytest.mark.integration

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stop",
    "seed",
    "logprobs",
    "model",
    "min_p",
    "stream_options",
    "input_ids",
    "sampling_params",
    "bootstrap_room",
    "presence_penalty",
    "frequency_penalty",
]
VALID = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
}


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    kind = draw(st.sampled_from(["mutate", "value", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "value":
        return path, json.dumps(draw(json_values)).encode()
    body = dict(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(FIELDS))] = draw(json_values)
    removable = sorted(k for k in body if k not in ("max_tokens", "sampling_params"))  # keep generations short
    if removable and draw(st.booleans()):
        body.pop(draw(st.sampled_from(removable)), None)
    return path, json.dumps(body).encode()


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_router_never_answers_a_client_error_with_5xx(stack, case):  # noqa: F811
    path, raw = case
    r = requests.post(
        f"{stack.router.url}{path}", data=raw, headers={"Content-Type": "application/json"}, timeout=scaled(60)
    )
    assert r.status_code < 500, (path, raw, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


def test_router_still_serves_after_the_fuzzing(stack):  # noqa: F811
    r = requests.post(f"{stack.router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=scaled(60))
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3
