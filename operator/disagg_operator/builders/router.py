"""The router: a Deployment that finds workers through the roles' headless Services, and its Service."""

from typing import Any

from disagg_api import router_settings as R
from disagg_api import settings as S
from disagg_api.setting import Setting, command_line

from .. import names
from ..config import OperatorConfig
from ..quantity import mebibytes, to_bytes
from ..spec import ModelSpec, Resources
from ..weights import LOGS, ROUTER_TMP
from .common import (
    base_env,
    container_security_context,
    drain_on_stop,
    metadata,
    pod_security_context,
    probes,
    role_labels,
    selector_labels,
    service_fqdn,
    tmp_volume,
)
from .placement import scheduling
from .secret import api_keys_file, api_keys_volume, auth_token_file, auth_volume
from .workers import model_volumes, tracing_settings

# What a router asks for when its CR says nothing: it is one asyncio process that forwards requests.
ROUTER_REQUESTS = {"cpu": "250m", "memory": "256Mi"}
ROUTER_LIMITS = {"memory": "1Gi"}


def router_args(spec: ModelSpec, cfg: OperatorConfig) -> list[str]:
    """`disagg router ...` arguments (after the `disagg` entrypoint), the CR's extra args last."""
    prefill = service_fqdn(spec, names.child_name(spec.name, names.PREFILL), cfg)
    decode = service_fqdn(spec, names.child_name(spec.name, names.DECODE), cfg)
    r = spec.router
    values: list[tuple[Setting, Any]] = [
        (S.HOST, "0.0.0.0"),
        (S.PORT, names.HTTP_PORT),
        (R.SERVED_MODEL_NAME, spec.served_model_name),
        (R.POLICY, r.policy),
        (R.PREFILL_DNS, f"{prefill}:{names.HTTP_PORT}"),
        (R.DECODE_DNS, f"{decode}:{names.HTTP_PORT}"),
        (R.BOOTSTRAP_PORT, names.BOOTSTRAP_PORT),
        (R.DRAIN_TIMEOUT, spec.drain_timeout_s),
        (R.AUTH_TOKEN_FILE, auth_token_file()),
    ]
    if spec.api_key_secret:
        values.append((S.API_KEY_FILE, api_keys_file()))
    if reads_model(spec):
        values.append((R.TOKENIZER, spec.model.model_arg))
    # Only when set: a flag every router gained would roll them all on upgrade.
    if r.decode_only_tokens:
        values.append((R.DECODE_ONLY_TOKENS, r.decode_only_tokens))
    if r.migration_limit is not None:
        values.append((R.MIGRATION_LIMIT, r.migration_limit))
    values += r.flow_control.settings()
    values += tracing_settings(spec)
    return [names.ROUTER, *command_line(values), *r.placement.args]


def reads_model(spec: ModelSpec) -> bool:
    """The cache-aware policy tokenises prompts as the workers do: the router mounts the model (its tokenizer)."""
    return spec.router.policy == "cache_aware"


def router_endpoint(spec: ModelSpec) -> str:
    return f"http://{names.child_name(spec.name, names.ROUTER)}.{spec.namespace}.svc:{names.HTTP_PORT}"


def router_resources(res: Resources) -> dict[str, Any]:
    """The CR's requests and limits over the router's defaults, key by key. As Kubernetes does, a request the
    CR leaves out follows the CR's limit, and a limit it leaves out follows its request; ephemeral storage
    covers /tmp and the logs."""
    storage = mebibytes(to_bytes(ROUTER_TMP) + to_bytes(LOGS))
    requests, limits = dict(res.requests), dict(res.limits)
    for key, value in {**ROUTER_REQUESTS, "ephemeral-storage": storage}.items():
        requests.setdefault(key, res.limits.get(key, value))
    for key, value in {**ROUTER_LIMITS, "ephemeral-storage": storage}.items():
        limits.setdefault(key, res.requests.get(key, value))
    return {"requests": requests, "limits": limits}


def build_router_deployment(spec: ModelSpec, cfg: OperatorConfig) -> dict[str, Any]:
    r = spec.router
    tmp_vol, tmp_mount = tmp_volume(ROUTER_TMP)
    secrets = [auth_volume(spec)] + ([api_keys_volume(spec.api_key_secret)] if spec.api_key_secret else [])
    model_vols, model_mounts = model_volumes(spec) if reads_model(spec) else ([], [])
    resources = router_resources(r.placement.resources)
    container = {
        "name": names.ROUTER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["disagg"],
        "args": router_args(spec, cfg),
        "env": base_env(spec) + [dict(v) for v in r.placement.env],
        "ports": [{"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"}],
        "resources": resources,
        "securityContext": container_security_context(ipc_lock=False),
        "volumeMounts": [tmp_mount] + [mount for _, mount in secrets] + model_mounts,
        # Ready from its first verified prefill->decode pair until it drains (/ready): a rollout's gap without a
        # pair is answered with 503 + Retry-After instead of emptying the Service. Alive while it answers (/livez).
        **probes(ready_path="/ready", live_path="/livez"),
        **drain_on_stop(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(spec, names.child_name(spec.name, names.ROUTER), names.ROUTER, names.ROUTER),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector_labels(spec, names.ROUTER)},
            "template": {
                "metadata": {"labels": role_labels(spec, names.ROUTER)},
                "spec": {
                    "containers": [container],
                    "volumes": [tmp_vol] + [volume for volume, _ in secrets] + model_vols,
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": spec.grace_period_s,
                    **scheduling(spec, names.ROUTER, r.placement),
                },
            },
        },
    }


def build_router_service(spec: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, names.child_name(spec.name, names.ROUTER), names.ROUTER, names.ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec, names.ROUTER),
            "ports": [{"name": "http", "port": names.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
