"""The router: a Deployment that finds workers through the roles' headless Services, and its Service."""

from typing import Any

from .. import names
from ..config import OperatorConfig
from ..spec import ModelSpec
from .common import (
    base_env,
    container_security_context,
    drain_on_stop,
    metadata,
    pod_security_context,
    probes,
    role_labels,
    scheduling,
    selector_labels,
    tmp_volume,
)
from .secret import api_keys_file, api_keys_volume, auth_token_file, auth_volume


def service_fqdn(spec: ModelSpec, service: str, cfg: OperatorConfig) -> str:
    return f"{service}.{spec.namespace}.svc.{cfg.cluster_domain}"


def router_args(spec: ModelSpec, cfg: OperatorConfig) -> list[str]:
    """`disagg router ...` arguments (after the `disagg` entrypoint), the CR's extra args last."""
    prefill = service_fqdn(spec, names.child_name(spec.name, names.PREFILL), cfg)
    decode = service_fqdn(spec, names.child_name(spec.name, names.DECODE), cfg)
    return [
        names.ROUTER,
        "--host",
        "0.0.0.0",
        "--port",
        str(names.HTTP_PORT),
        "--served-model-name",
        spec.served_model_name,
        "--policy",
        spec.router.policy,
        "--prefill-dns",
        f"{prefill}:{names.HTTP_PORT}",
        "--decode-dns",
        f"{decode}:{names.HTTP_PORT}",
        "--bootstrap-port",
        str(names.BOOTSTRAP_PORT),
        "--drain-timeout",
        str(spec.drain_timeout_s),
        "--auth-token-file",
        auth_token_file(),
        *(["--api-key-file", api_keys_file()] if spec.api_key_secret else []),
    ] + list(spec.router.placement.args)


def router_endpoint(spec: ModelSpec) -> str:
    return f"http://{names.child_name(spec.name, names.ROUTER)}.{spec.namespace}.svc:{names.HTTP_PORT}"


def build_router_deployment(spec: ModelSpec, cfg: OperatorConfig) -> dict[str, Any]:
    r = spec.router
    tmp_vol, tmp_mount = tmp_volume()
    secrets = [auth_volume(spec)] + ([api_keys_volume(spec.api_key_secret)] if spec.api_key_secret else [])
    res = r.placement.resources
    resources = {k: dict(v) for k, v in (("requests", res.requests), ("limits", res.limits)) if v}
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
        "volumeMounts": [tmp_mount] + [mount for _, mount in secrets],
        # Ready only while it has a verified prefill->decode pair (/health); alive as long as it answers (/livez).
        **probes(live_path="/livez"),
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
                    "volumes": [tmp_vol] + [volume for volume, _ in secrets],
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": spec.grace_period_s,
                    **scheduling(r.placement),
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
