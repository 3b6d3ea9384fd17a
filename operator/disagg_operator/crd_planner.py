"""Schema of `spec.scaling.slo` and `spec.scaling.planner`: the latency targets and the planner that sizes prefill
and decode to hold them (its decision: planner/). Composed into `spec.scaling` by crd.py."""

from . import names
from .schema import integer, obj, string

MODES = ("Off", "Advisory", "Apply")
RELATIONS = ("Independent", "PrefillPerDecode")
DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 8
DEFAULT_INTERVAL_S = 60
DEFAULT_CORRECTION_INTERVAL_S = 10
DEFAULT_MAX_STEP = 4
DEFAULT_STABILIZATION_S = 300
DEFAULT_PERCENTILE = 90

PLANNER = "self.planner"


def _bound(role: str, field: str, default: int, at: str = PLANNER) -> str:
    """A role's bound in CEL, its default where unset (the bounds carry no schema default, so a rule can tell a
    bound the user set from none)."""
    block = f"{at}.{role}"
    return f"(has({block}) && has({block}.{field}) ? {block}.{field} : {default})"


def _least_gpus() -> str:
    """The GPUs both roles' minimums take, as seen from spec."""
    at = "self.scaling.planner"
    return " + ".join(
        f"{_bound(r, 'minReplicas', DEFAULT_MIN_REPLICAS, at)} * self.{r}.resources.gpus" for r in names.WORKER_ROLES
    )


PLANNER_RULES: list[tuple[str, str, str]] = (
    [
        (
            "spec.scaling",
            f"!has(self.slo) || !has({PLANNER}) || {PLANNER}.mode != 'Off'",
            "scaling.slo is the planner's target, and planner.mode Off holds nothing to it: set mode Advisory or "
            "Apply, or remove scaling.slo",
        ),
        (
            "spec.scaling",
            f"!has({PLANNER}) || {PLANNER}.mode == 'Off' || has(self.slo)",
            "planner.mode Advisory or Apply sizes the roles to scaling.slo: set scaling.slo (ttftMs, itlMs)",
        ),
        (
            "spec.scaling",
            f"!has({PLANNER}) || {PLANNER}.relation != 'PrefillPerDecode' || has(self.prefillPerDecode)",
            "planner.relation PrefillPerDecode keeps scaling.prefillPerDecode prefill pods per decode pod: set it",
        ),
        (
            "spec.scaling",
            f"!has({PLANNER}) || {PLANNER}.relation != 'Independent' || !has(self.prefillPerDecode)",
            "planner.relation Independent sizes prefill itself, but scaling.prefillPerDecode makes prefill follow "
            "decode: remove prefillPerDecode or set relation PrefillPerDecode",
        ),
        (
            "spec.scaling",
            f"!has({PLANNER}) || {PLANNER}.relation != 'PrefillPerDecode' || !has({PLANNER}.prefill)",
            "with planner.relation PrefillPerDecode prefill follows decode: bound planner.decode, not planner.prefill",
        ),
        (
            "spec.scaling",
            f"!has({PLANNER}) || {PLANNER}.correctionIntervalSeconds <= {PLANNER}.intervalSeconds",
            "planner.correctionIntervalSeconds (the fast loop) must not exceed intervalSeconds (the slow loop)",
        ),
    ]
    + [
        (
            "spec.scaling",
            f"!has({PLANNER}) || {_bound(r, 'minReplicas', DEFAULT_MIN_REPLICAS)} <= "
            f"{_bound(r, 'maxReplicas', DEFAULT_MAX_REPLICAS)}",
            f"planner.{r}.minReplicas must not exceed planner.{r}.maxReplicas (defaults {DEFAULT_MIN_REPLICAS} and "
            f"{DEFAULT_MAX_REPLICAS})",
        )
        for r in names.WORKER_ROLES
    ]
    + [
        (
            "spec",
            "!has(self.scaling.planner) || !has(self.scaling.planner.gpuBudget) || "
            f"self.scaling.planner.gpuBudget >= {_least_gpus()}",
            "scaling.planner.gpuBudget is below what the minimum replicas take (minReplicas x resources.gpus of "
            "prefill plus decode): raise the budget or lower the minimums",
        ),
    ]
)


def _role_bounds(role: str) -> dict:
    return obj(
        {
            "minReplicas": integer(
                None, 0, f"The fewest {role} replicas the planner keeps (default {DEFAULT_MIN_REPLICAS})."
            ),
            "maxReplicas": integer(
                None, 1, f"The most {role} replicas the planner asks for (default {DEFAULT_MAX_REPLICAS})."
            ),
        },
        f"The planner's bounds on {role}.",
    )


def slo_schema() -> dict:
    positive = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 3_600_000}
    percentile = {
        "type": "number",
        "minimum": 50,
        "maximum": 100,
        "exclusiveMaximum": True,
        "default": DEFAULT_PERCENTILE,
        "description": "The percentile of requests both targets hold at, e.g. 90 or 99.",
    }
    return obj(
        {
            "ttftMs": {**positive, "description": "Time to the first token, in milliseconds."},
            "itlMs": {**positive, "description": "Time between two generated tokens of a request, in milliseconds."},
            "percentile": percentile,
        },
        "The latency targets the planner sizes prefill (TTFT) and decode (ITL) to hold.",
        required=["ttftMs", "itlMs"],
    )


def _ms(doc: str) -> dict:
    return {"type": "number", "minimum": 0, "maximum": 3_600_000, "description": doc}


def profile_schema() -> dict:
    """A step-time model measured beforehand: what the planner sizes by until workers record their steps."""
    return obj(
        {
            "prefillBaseMs": _ms("A prefill step's fixed cost, in milliseconds."),
            "prefillMsPerToken": _ms("A prefill step's cost per prompt token it computes, in milliseconds."),
            "decodeBaseMs": _ms("A decode step's fixed cost (reading the weights), in milliseconds."),
            "decodeMsPerKvToken": _ms("A decode step's cost per KV token its requests attend to, in milliseconds."),
            "maxPrefillTokens": integer(None, 1, "The most prompt tokens one prefill step takes (its chunk)."),
            "decodeKvTokens": integer(None, 1, "The KV tokens one decode replica's pool holds for requests."),
        },
        "Each role's step time as base + per token x tokens, measured on this model and device. Without it the "
        "planner has no capacity model and holds the current replicas.",
        required=["prefillBaseMs", "prefillMsPerToken", "decodeBaseMs", "decodeMsPerKvToken"],
    )


def planner_schema() -> dict:
    return obj(
        {
            "mode": string(
                "Off: no decision. Advisory: decide and report, write nothing. Apply: decide and write the replicas.",
                16,
                enum=list(MODES),
                default="Advisory",
            ),
            "intervalSeconds": integer(
                DEFAULT_INTERVAL_S, 5, "How often the slow loop sizes each role from the predicted load.", 3600
            ),
            "correctionIntervalSeconds": integer(
                DEFAULT_CORRECTION_INTERVAL_S,
                1,
                "How often the fast loop corrects a role by one replica on the measured latency.",
                3600,
            ),
            names.PREFILL: _role_bounds(names.PREFILL),
            names.DECODE: _role_bounds(names.DECODE),
            "gpuBudget": integer(
                None, 0, "The most GPUs prefill and decode replicas take together; decode is served first."
            ),
            "relation": string(
                "Independent: prefill and decode are sized each to its own load. PrefillPerDecode: decode is sized "
                "so that scaling.prefillPerDecode prefill pods per decode pod meet both roles' loads.",
                24,
                enum=list(RELATIONS),
                default="Independent",
            ),
            "maxStepReplicas": integer(DEFAULT_MAX_STEP, 1, "The most replicas one decision adds or removes per role."),
            "profile": profile_schema(),
            "scaleDownStabilizationSeconds": integer(
                DEFAULT_STABILIZATION_S,
                0,
                "A scale-down goes only to the highest recommendation of this window (as an HPA's does).",
                86400,
            ),
        },
        "The SLO planner: sizes prefill and decode to hold scaling.slo.",
    )
