"""Who a request is to flow control: its priority (its band) and its flow (whom fairness is between).

- Priority: the objective the header `x-gateway-inference-objective` names, as the deployment declared it
  (`--flow-objectives`); else the body's `priority` field, an integer, higher first (SGLang's default order and
  the Gateway API Inference Extension's; vLLM's `priority` is the other way round, lower first); else 0. Then it
  is capped at what the caller's API key allows (`FlowPolicy.capped`). An unknown objective, a priority that is
  not an integer or outside the allowed range: 400 naming the header or the field.
- Flow: the caller where the server takes API keys (`http.auth.caller_of`: a digest of the key, so that a client
  cannot pose as another); else the header `x-gateway-inference-fairness-id`; else one shared flow, "".

The body is read by the admission before the request waits (it needs the priority), and the router parses it
only after: `body_priority` looks for the field without parsing a body that cannot hold it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from disagg_worker.flow.policy import DEFAULT_PRIORITY, FlowPolicy
from disagg_worker.request.errors import APIError, bad_request

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# A fairness id longer than this is cut: it names a flow, a key of the queue's maps, not a payload.
MAX_FLOW_CHARS = 128
ABSENT = object()  # a body without a `priority` field


@dataclass(frozen=True)
class Identity:
    priority: int = DEFAULT_PRIORITY
    flow: str = ""

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


def body_priority(body: bytes) -> object:
    """The body's `priority` field as sent, or `ABSENT` (also for a body that is not a JSON object: the handler
    answers that one). Only a body that holds the word is parsed (a key spelled with escapes is not seen)."""
    if b'"priority"' not in body:
        return ABSENT
    try:
        parsed = json.loads(body)
    except ValueError:
        return ABSENT
    return parsed.get("priority", ABSENT) if isinstance(parsed, dict) else ABSENT


def identify(policy: FlowPolicy, headers: Mapping[str, str], priority: object, caller: str) -> Identity:
    """The request's identity (see the module); `priority`: the body's field (`body_priority`)."""
    flow = caller or headers.get(FAIRNESS_HEADER, "")[:MAX_FLOW_CHARS]
    return Identity(policy.capped(_asked(policy, headers, priority), caller), flow)


def _asked(policy: FlowPolicy, headers: Mapping[str, str], priority: object) -> int:
    objective = headers.get(OBJECTIVE_HEADER)
    if objective is not None:
        if objective not in policy.objectives:
            known = ", ".join(sorted(policy.objectives)) or "none"
            message = f"{OBJECTIVE_HEADER}: unknown objective {objective!r} (declared: {known})"
            raise bad_request(message, OBJECTIVE_HEADER)
        return policy.objectives[objective]
    if priority is ABSENT or priority is None:
        return DEFAULT_PRIORITY
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise bad_request(f"priority: must be an integer, got {json.dumps(priority)[:40]}", "priority")
    if not policy.allows(priority):
        raise _outside(policy, priority)
    return priority


def _outside(policy: FlowPolicy, priority: int) -> APIError:
    message = f"priority: must be between {policy.min_priority} and {policy.max_priority}, got {priority}"
    return bad_request(message, "priority")
