"""The status schema of the DisaggregatedModel CRD: per-role counts, the rollout in progress, KV handoff health,
the KV store, the gateway's pool and picker, and the conditions."""

from . import names
from .schema import conditions, integer, obj


def _role_status() -> dict:
    return obj(
        {
            "replicas": integer(),
            "readyReplicas": integer(),
            "updatedReplicas": integer(),
            "ready": {"type": "string", "description": "ready/desired, for printing."},
            "selector": {"type": "string", "description": "Label selector of the role's pods (for an HPA)."},
        }
    )


def _rollout_status() -> dict:
    progress = obj(
        {
            "released": integer(doc="Pods the partition lets onto the new template."),
            "updatedReady": integer(doc="Pods on the new template and available."),
        }
    )
    return obj(
        {
            "revision": {"type": "string", "description": "Pairing revision the worker pods are moving to."},
            "step": integer(doc="Pods released so far, both roles together."),
            "steps": integer(doc="Pods to update, both roles together."),
            names.PREFILL: progress,
            names.DECODE: progress,
            "lastProgressTime": {"type": "string", "format": "date-time"},
            "inPlace": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Surge pods no node was found for: this rollout replaces pods in place instead.",
            },
        },
        "Present while the worker pods move to a new template.",
    )


def _transfer_status() -> dict:
    counts = obj(
        {
            "bootstrapFailures": integer(doc="Requests that failed before their KV transfer started."),
            "transferFailures": integer(doc="KV transfers that failed."),
        }
    )
    return obj(
        {
            "windowSeconds": integer(doc="The counts cover this many recent seconds."),
            names.PREFILL: counts,
            names.DECODE: counts,
            "failingPods": {"type": "array", "items": {"type": "string"}},
        },
        "KV handoff health as the router sees it (absent when the operator cannot reach the router pods).",
    )


def _kvstore_status() -> dict:
    return obj(
        {
            "readyReplicas": integer(),
            "ready": {"type": "string", "description": "ready/desired (1), for printing."},
            "master": {"type": "string", "description": "Where workers reach mooncake_master (host:port)."},
        },
        "Mooncake Store's pod (present with spec.kvCache.store).",
    )


def _gateway_status() -> dict:
    return obj(
        {
            "pool": {"type": "string", "description": "The InferencePool an HTTPRoute's backendRef names."},
            "endpointPicker": {"type": "string", "description": "The picker's Service, host:port of ext_proc."},
            "httpRoute": {"type": "string", "description": "The HTTPRoute made for spec.gateway.httpRoute."},
            "readyReplicas": integer(),
            "ready": {"type": "string", "description": "Picker pods ready/desired, for printing."},
        },
        "The model's InferencePool and endpoint picker (present with spec.gateway).",
    )


def _planner_status() -> dict:
    roles = obj({names.PREFILL: integer(), names.DECODE: integer()})
    return obj(
        {
            "mode": {"type": "string", "description": "Advisory (reports only) or Apply (writes the replicas)."},
            "desired": roles,
            "current": roles,
            "reason": {"type": "string", "description": "How the desired replicas were reached, in words."},
            "estimatedTtftMs": integer(doc="TTFT the capacity model expects at the desired replicas."),
            "estimatedItlMs": integer(doc="ITL the capacity model expects at the desired replicas."),
            "unreachable": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The roles whose latency target no replica count meets.",
            },
            "advisoryRoles": {
                "type": "array",
                "items": {"type": "string"},
                "description": "In Apply, the roles left alone because an HPA targets their scale subresource.",
            },
            "lastDecisionTime": {"type": "string", "format": "date-time", "description": "When this changed."},
        },
        "The SLO planner's latest recommendation (present with spec.scaling.planner mode Advisory or Apply).",
    )


def status_schema() -> dict:
    return obj(
        {
            "observedGeneration": integer(),
            "endpoint": {"type": "string", "description": "URL of the router Service inside the cluster."},
            **{role: _role_status() for role in names.ROLES},
            "rollout": _rollout_status(),
            "transfer": _transfer_status(),
            "kvStore": _kvstore_status(),
            "gateway": _gateway_status(),
            "planner": _planner_status(),
            "conditions": conditions(),
        }
    )
