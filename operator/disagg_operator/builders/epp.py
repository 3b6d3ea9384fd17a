"""The model's endpoint picker (`disagg epp`, `spec.gateway`): a Deployment that a Gateway API gateway asks, over
Envoy's ext_proc, which decode pod takes each request; its Service, and the identity its pods run as.

The picker finds the pool's pods as the router finds them, through the decode role's headless Service
(`--endpoint-dns`), and the prefills through theirs (`--prefill-dns`), and reads their /health and KV events with
the model's worker token (`--auth-token-file`).
It makes no Kubernetes API call, so it is granted none: a ServiceAccount of its own (not the namespace's default,
which others may bind roles to) with no Role, and its pods mount no token.
"""

from typing import Any

from disagg_api import epp_settings as E
from disagg_api import router_settings as R
from disagg_api import settings as S
from disagg_api.setting import Setting, command_line

from .. import names
from ..config import OperatorConfig
from ..gateway_spec import GatewaySpec
from ..spec import ModelSpec
from ..weights import ROUTER_TMP
from .common import (
    base_env,
    container_security_context,
    metadata,
    pod_security_context,
    role_labels,
    selector_labels,
    service_fqdn,
    tmp_volume,
)
from .placement import scheduling
from .router import router_resources
from .secret import auth_token_file, auth_volume
from .workers import model_volumes

GRPC_PORT = E.GRPC_PORT.default
HEALTH_PORT = E.GRPC_HEALTH_PORT.default
METRICS_PORT = E.METRICS_PORT.default


def epp_args(spec: ModelSpec, gateway: GatewaySpec, cfg: OperatorConfig) -> list[str]:
    """`disagg epp ...` arguments (after the `disagg` entrypoint), the block's extra args last. The endpoints are
    the decode pods, and the picker runs in P/D mode: it also picks each request's prefill among the prefill pods
    and names it in x-prefiller-host-port, which the decode pod it sends the request to hands the prompt to."""
    decode = service_fqdn(spec, names.child_name(spec.name, names.DECODE), cfg)
    prefill = service_fqdn(spec, names.child_name(spec.name, names.PREFILL), cfg)
    values: list[tuple[Setting, Any]] = [
        (S.HOST, "0.0.0.0"),
        (E.GRPC_PORT, GRPC_PORT),
        (E.GRPC_HEALTH_PORT, HEALTH_PORT),
        (E.METRICS_PORT, METRICS_PORT),
        (R.SERVED_MODEL_NAME, spec.served_model_name),
        (E.ENDPOINT_DNS, f"{decode}:{names.HTTP_PORT}"),
        (E.PREFILL_DNS, f"{prefill}:{names.HTTP_PORT}"),
        (R.POLICY, gateway.policy),
        (R.AUTH_TOKEN_FILE, auth_token_file()),
    ]
    if gateway.reads_model:
        values.append((R.TOKENIZER, spec.model.model_arg))
    return [names.EPP, *command_line(values), *gateway.placement.args]


def _grpc_probe(service: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": HEALTH_PORT, "service": service},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def build_epp_deployment(spec: ModelSpec, gateway: GatewaySpec, cfg: OperatorConfig) -> dict[str, Any]:
    name = names.epp_name(spec.name)
    tmp_vol, tmp_mount = tmp_volume(ROUTER_TMP)
    auth_vol, auth_mount = auth_volume(spec)
    model_vols, model_mounts = model_volumes(spec) if gateway.reads_model else ([], [])
    container = {
        "name": names.EPP,
        "image": gateway.image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["disagg"],
        "args": epp_args(spec, gateway, cfg),
        "env": base_env(spec) + [dict(v) for v in gateway.placement.env],
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": router_resources(gateway.placement.resources),
        "securityContext": container_security_context(ipc_lock=False),
        "volumeMounts": [tmp_mount, auth_mount] + model_mounts,
        # Ready while at least one decode pod is healthy (the picker's `readiness` service); alive while it answers.
        "readinessProbe": _grpc_probe("readiness", 5, 3),
        "livenessProbe": _grpc_probe("liveness", 10, 6),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(spec, name, names.EPP, names.EPP),
        "spec": {
            "replicas": gateway.replicas,
            "selector": {"matchLabels": selector_labels(spec, names.EPP)},
            "template": {
                "metadata": {"labels": role_labels(spec, names.EPP)},
                "spec": {
                    "serviceAccountName": name,
                    "containers": [container],
                    "volumes": [tmp_vol, auth_vol] + model_vols,
                    "securityContext": pod_security_context(),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    **scheduling(spec, names.EPP, gateway.placement),
                },
            },
        },
    }


def build_epp_service(spec: ModelSpec) -> dict[str, Any]:
    """What the InferencePool's endpointPickerRef names: ext_proc (HTTP/2, as gateways must speak it to the
    picker), gRPC health and the metrics."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, names.epp_name(spec.name), names.EPP, names.EPP),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec, names.EPP),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {"name": "grpc-health", "port": HEALTH_PORT, "targetPort": "grpc-health", "protocol": "TCP"},
                {"name": "http-metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def build_epp_service_account(spec: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(spec, names.epp_name(spec.name), names.EPP, names.EPP),
        "automountServiceAccountToken": False,
    }


def epp_endpoint(spec: ModelSpec) -> str:
    """Where a gateway reaches the picker: its Service's ext_proc port."""
    return f"{names.epp_name(spec.name)}.{spec.namespace}.svc:{GRPC_PORT}"
