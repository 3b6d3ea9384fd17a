"""Schema of `spec.router.flowControl`: the router's flow control (its `--flow-*` flags, docs/flow-control.md),
and its CEL rules. Composed into `spec.router` by crd_roles.py."""

from disagg_api import router_settings as R

from .schema import integer, obj, rule, string

FLOW = "spec.router.flowControl"
# A name a client can send as a header value as it is: letters and digits, '-', '_' and '.' inside.
OBJECTIVE_NAME = "^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# How the router names an API key (`--flow-key-priority`): the first 32 hex digits of its SHA-256.
KEY_DIGEST = "^[0-9a-f]{32}$"
WITHIN = "self.minPriority <= {p}.priority && {p}.priority <= self.maxPriority"
DEFAULT_RANGE = f"(default {R.FLOW_MIN_PRIORITY.default} and {R.FLOW_MAX_PRIORITY.default})"

# (where, rule, message) checked by the API server, as crd.RULES.
FLOW_RULES: list[tuple[str, str, str]] = [
    (
        FLOW,
        "self.minPriority <= self.maxPriority",
        "router.flowControl.minPriority must not exceed router.flowControl.maxPriority",
    ),
    (
        FLOW,
        "self.queueSize >= 1",
        "router.flowControl.queueSize must be 1 or more: it is how many requests may wait for a slot",
    ),
    (
        FLOW,
        "self.queueTTLSeconds > 0.0",
        "router.flowControl.queueTTLSeconds must be above 0: a request waits at most this long before a 429",
    ),
    (
        FLOW,
        "!has(self.objectives) || self.objectives.all(o, self.objectives.exists_one(p, p.name == o.name))",
        "router.flowControl.objectives must name each objective once: a client's header names one priority",
    ),
    (
        FLOW,
        f"!has(self.objectives) || self.objectives.all(o, o.name.matches('{OBJECTIVE_NAME}'))",
        "router.flowControl.objectives[].name must be letters, digits, '-', '_' and '.', starting and ending with "
        "a letter or digit: clients send it as the x-gateway-inference-objective header",
    ),
    (
        FLOW,
        f"!has(self.objectives) || self.objectives.all(o, {WITHIN.format(p='o')})",
        "router.flowControl.objectives[].priority must lie within router.flowControl.minPriority and maxPriority "
        + DEFAULT_RANGE,
    ),
    (
        FLOW,
        f"!has(self.keyPriorities) || self.keyPriorities.all(k, k.digest.matches('{KEY_DIGEST}'))",
        "router.flowControl.keyPriorities[].digest must be the first 32 hex digits (lowercase) of the API key's "
        'SHA-256 (printf %s "$KEY" | sha256sum | cut -c1-32), never the key itself',
    ),
    (
        FLOW,
        "!has(self.keyPriorities) || self.keyPriorities.all(k, self.keyPriorities.exists_one(j, j.digest == k.digest))",
        "router.flowControl.keyPriorities must list each key's digest once: a key has one highest priority",
    ),
    (
        FLOW,
        f"!has(self.keyPriorities) || self.keyPriorities.all(k, {WITHIN.format(p='k')})",
        "router.flowControl.keyPriorities[].priority must lie within router.flowControl.minPriority and "
        "maxPriority " + DEFAULT_RANGE,
    ),
    (
        "spec",
        "!has(self.router.flowControl) || !has(self.router.flowControl.keyPriorities) || "
        "self.router.flowControl.keyPriorities.size() == 0 || has(self.apiKeySecret)",
        "router.flowControl.keyPriorities caps API keys' priorities: it needs apiKeySecret (without API keys the "
        "router cannot tell one client's requests from another's)",
    ),
]


def _rules_at(where: str) -> list[dict]:
    return [rule(expression, message) for w, expression, message in FLOW_RULES if w == where]


def _priorities(key: dict, priority: str, max_items: int, doc: str) -> dict:
    item = obj({**key, "priority": integer(doc=priority)}, required=[*key, "priority"])
    return {"type": "array", "maxItems": max_items, "items": item, "description": doc}


def flow_control_schema() -> dict:
    objective = {"name": string("The objective's name, as clients send it in x-gateway-inference-objective.", 63)}
    digest = {"digest": string("The API key's digest: the first 32 hex digits of its SHA-256.", 64)}
    return obj(
        {
            "enabled": {
                "type": "boolean",
                "default": True,
                "description": "false turns flow control off while keeping these settings.",
            },
            "queueSize": integer(
                R.FLOW_QUEUE_SIZE.default,
                doc="Requests waiting at most per router pod (`--flow-queue-size`); when full, the lowest priority "
                "is shed.",
            ),
            "queueTTLSeconds": {
                "type": "number",
                "default": R.FLOW_QUEUE_TTL.default,
                "description": "Seconds a request may wait before it is answered 429 (`--flow-queue-ttl`).",
            },
            "minPriority": integer(
                R.FLOW_MIN_PRIORITY.default, doc="The lowest priority a request may ask for (`--flow-min-priority`)."
            ),
            "maxPriority": integer(
                R.FLOW_MAX_PRIORITY.default, doc="The highest priority a request may ask for (`--flow-max-priority`)."
            ),
            "objectives": _priorities(
                objective,
                "Its priority: higher is served first, below 0 is sheddable.",
                64,
                "What the header x-gateway-inference-objective may name, each with its priority "
                "(`--flow-objectives`); a request naming another is refused (400).",
            ),
            "keyPriorities": _priorities(
                digest,
                "The highest priority the key's requests get.",
                256,
                "The highest priority of each API key's requests, the key named by its digest (`--flow-key-"
                "priority`); a request asking for more is served at it. Needs apiKeySecret.",
            ),
        },
        "Flow control at the router (`--flow-control`, docs/flow-control.md): requests beyond its in-flight "
        "limit wait in a queue, the highest priority first, API keys (else x-gateway-inference-fairness-id) "
        "round-robin within a priority, the lowest shed first. Absent: off (beyond the limit, 429 at once).",
        rules=_rules_at(FLOW),
    )
