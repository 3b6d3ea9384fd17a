"""Prefill and decode: command lines, pod templates, StatefulSets and their headless Services."""

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from disagg_api import settings as S
from disagg_api.setting import Setting, command_line

from .. import names
from ..config import DEFAULT_CFG, OperatorConfig
from ..spec import ModelSpec, WorkerRoleSpec
from ..weights import SHM, WORKER_TMP, cache_size, worker_ephemeral_storage
from .common import (
    base_env,
    container_security_context,
    drain_on_stop,
    front_end_labels,
    metadata,
    pod_security_context,
    probes,
    role_labels,
    selector_labels,
    service_fqdn,
    tmp_volume,
)
from .kvstore import tier_settings, with_host_tier
from .placement import scheduling
from .ports import port_settings
from .secret import api_keys_file, api_keys_volume, auth_token_file, auth_volume


def worker_args(spec: ModelSpec, role: str, cfg: OperatorConfig = DEFAULT_CFG) -> list[str]:
    """`disagg prefill|decode ...` arguments (after the `disagg` entrypoint), the CR's extra args last."""
    return [role, *command_line(worker_settings(spec, role, cfg)), *spec.worker(role).placement.args]


def worker_settings(spec: ModelSpec, role: str, cfg: OperatorConfig = DEFAULT_CFG) -> list[tuple[Setting, Any]]:
    """What a worker of `role` is told, in the order of its command line: a flag that moved, or that every pod
    gained, would change every pod template and roll every existing model's pods on upgrade.

    A role with GPUs runs its ranks on CUDA (the worker then joins them with NCCL), one without on the CPU (gloo).
    """
    w = spec.worker(role)
    out: list[tuple[Setting, Any]] = [
        (S.MODEL, spec.model.model_arg),
        (S.SERVED_MODEL_NAME, spec.served_model_name),
        (S.HOST, "0.0.0.0"),
        (S.PORT, names.HTTP_PORT),
        (S.ADVERTISE_HOST, "$(POD_IP)"),
    ]
    if role == names.PREFILL:
        out.append((S.BOOTSTRAP_PORT, names.BOOTSTRAP_PORT))
    if w.nodes > 1:  # one pod of a group: LWS injects where the leader is and which pod this is (builders/groups.py)
        out += [(S.NNODES, w.nodes), (S.NODE_RANK, "$(LWS_WORKER_INDEX)")]
        out.append((S.DIST_INIT_ADDR, f"$(LWS_LEADER_ADDRESS):{names.DIST_PORT}"))
    out += port_settings(spec, role) + [(S.AUTH_TOKEN_FILE, auth_token_file())]
    out += [(S.TRANSFER_BACKEND, spec.transfer.backend), (S.TRANSFER_PROTOCOL, spec.transfer.protocol)]
    if spec.transfer.ib_device:
        out.append((S.IB_DEVICE, spec.transfer.ib_device))
    out += [(S.DEVICE, "cuda" if w.placement.resources.gpus else "cpu"), (S.TP_SIZE, w.tp_size), (S.PP_SIZE, w.pp_size)]
    # Only when set: a flag every pod gained would roll every existing model's pods on upgrade.
    local_prefill = role == names.DECODE and bool(spec.router.decode_only_tokens)
    optional = [(S.EP_SIZE, w.ep_size), (S.ENABLE_DP_ATTENTION, w.dp_attention), (S.DP_SIZE, w.dp_size)]
    optional += [(S.DECODE_PREFIX_CACHE, w.prefix_cache), (S.LOCAL_PREFILL, local_prefill)]
    out += [(setting, value) for setting, value in optional if value != setting.default]
    out += handoff_settings(spec, role, cfg) + w.engine.settings() + [(S.DRAIN_TIMEOUT, spec.drain_timeout_s)]
    s = spec.speculative
    if s is not None and (role == names.DECODE or s.draft_arg is not None):
        # Decode drafts; prefill runs a draft model over the prompt, and needs nothing for NGRAM (a flag it
        # ignored would only roll its pods). Only when set, like --ep-size.
        out += s.settings()
    out += spec.lora.settings() if spec.lora is not None else []  # the same on both roles; only when set
    return out + tracing_settings(spec) + tier_settings(spec, role)


def takes_gateway_clients(spec: ModelSpec, role: str) -> bool:
    """Whether `role`'s pods take clients' requests from a Gateway API gateway (`spec.gateway`: the decode pods)."""
    return spec.gateway is not None and role == names.DECODE


def handoff_settings(spec: ModelSpec, role: str, cfg: OperatorConfig) -> list[tuple[Setting, Any]]:
    """A decode pod behind a gateway takes requests whose x-prefiller-host-port names the prefill the picker chose,
    and sends that prefill the prompt: it admits exactly the model's prefill pods, the addresses their headless
    Service resolves to (`--prefill-allow`); and it takes the clients' API keys (`spec.apiKeySecret`), as the router
    does, beside the router's worker token. Nothing without the block: no pod rolls for it."""
    if not takes_gateway_clients(spec, role):
        return []
    out: list[tuple[Setting, Any]] = [
        (S.PREFILL_ALLOW, service_fqdn(spec, names.child_name(spec.name, names.PREFILL), cfg))
    ]
    if spec.api_key_secret:
        out.append((S.API_KEY_FILE, api_keys_file()))
    return out


def tracing_settings(spec: ModelSpec) -> list[tuple[Setting, Any]]:
    """The router's and every worker's tracing flags (none without `spec.tracing`: no pod rolls for it)."""
    t = spec.tracing
    if t is None:
        return []
    return [(S.OTLP_TRACES_ENDPOINT, t.otlp_endpoint), (S.OTLP_TRACES_SAMPLING_RATIO, t.sampling_ratio)]


def _digest(obj: Any, length: int) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:length]


def pairing_revision(spec: ModelSpec) -> str:
    """What prefill and decode must agree on to exchange KV pages, hashed: the image (its code and wire format),
    the model, the transfer, the page size, the KV dtype, a draft model and the LoRA adapters (their names and
    files). Both roles' pods carry the same value."""
    e = spec.prefill.engine
    parts: list[Any] = [spec.image, spec.model.model_arg, spec.transfer.backend, spec.transfer.protocol]
    parts += [e.page_size, e.kv_dtype]
    if spec.speculative is not None and spec.speculative.draft_arg is not None:  # its KV travels with the pages
        parts += [spec.speculative.algorithm, spec.speculative.draft_arg]
    if spec.lora is not None:  # KV computed under an adapter is decoded under the same one (only when set)
        parts += [[a.name, *a.source()] for a in spec.lora.adapters]
    return _digest(parts, 10)


def template_hash(template: Mapping[str, Any]) -> str:
    return _digest(template, 16)


def worker_env(spec: ModelSpec, w: WorkerRoleSpec) -> list[dict[str, Any]]:
    revision = {"fieldRef": {"fieldPath": f"metadata.labels['{names.REVISION_LABEL}']"}}
    env = base_env(spec) + [{"name": names.REVISION_ENV, "valueFrom": revision}]
    if spec.model.hugging_face_id:
        env.append({"name": "HF_HOME", "value": names.HF_CACHE_MOUNT})
    return env + [dict(v) for v in w.placement.env]


def worker_resources(spec: ModelSpec, w: WorkerRoleSpec, cfg: OperatorConfig) -> dict[str, Any]:
    """The user's requests/limits plus GPUs, the RDMA device when the transfer runs over RDMA, and ephemeral
    storage for the download cache, /tmp and logs (weights.py) unless the user set it; the memory the user set
    grows by the host KV tier's `hostSize` (builders/kvstore.py)."""
    r = w.placement.resources
    storage = worker_ephemeral_storage(spec.model)
    # As Kubernetes does, a request the CR leaves out follows its limit and a limit it leaves out its request:
    # a request above the limit is a pod the API server refuses.
    key = "ephemeral-storage"
    requests = {**dict(r.requests), key: r.requests.get(key, r.limits.get(key, storage))}
    limits = {**dict(r.limits), key: r.limits.get(key, r.requests.get(key, storage))}
    requests, limits = with_host_tier(spec, w.role, requests), with_host_tier(spec, w.role, limits)
    if r.gpus:
        limits[cfg.gpu_resource] = r.gpus
    if spec.transfer.rdma and r.rdma:
        limits[cfg.rdma_resource] = r.rdma
    return {"requests": requests, "limits": limits}


def model_volumes(spec: ModelSpec) -> tuple[list[dict], list[dict]]:
    """Volumes and mounts holding the weights: the PVC or hostPath read-only, or a Hugging Face cache; none for a
    model built into the image."""
    m = spec.model
    source: dict[str, Any]
    if m.builtin:
        return [], []
    if m.hugging_face_id:
        claim = {"persistentVolumeClaim": {"claimName": m.cache_pvc}}
        size = cache_size(m)
        source = claim if m.cache_pvc else {"emptyDir": {"sizeLimit": size} if size else {}}
        return [{"name": "hf-cache", **source}], [{"name": "hf-cache", "mountPath": names.HF_CACHE_MOUNT}]
    if m.pvc:
        source = {"persistentVolumeClaim": {"claimName": m.pvc, "readOnly": True}}
    else:
        source = {"hostPath": {"path": m.host_path, "type": "Directory"}}
    return [{"name": "model", **source}], [{"name": "model", "mountPath": names.MODEL_MOUNT, "readOnly": True}]


def worker_ports(role: str) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"}]
    if role == names.PREFILL:
        ports.append({"name": "bootstrap", "containerPort": names.BOOTSTRAP_PORT, "protocol": "TCP"})
    return ports


def llmd_labels(role: str) -> dict[str, str]:
    """llm-d's labels of a worker pod: its P/D role and SGLang's protocol, which llm-d's endpoint picker and its
    routing sidecar drive (the bootstrap fields in the body; docs/routing.md, "P/D through a gateway")."""
    return {names.LLMD_ROLE_LABEL: role, names.LLMD_ENGINE_LABEL: names.LLMD_ENGINE}


def worker_pod_template(spec: ModelSpec, role: str, cfg: OperatorConfig) -> dict[str, Any]:
    w = spec.worker(role)
    vols, mounts = model_volumes(spec)
    tmp_vol, tmp_mount = tmp_volume(WORKER_TMP)
    auth_vol, auth_mount = auth_volume(spec)
    if spec.api_key_secret and takes_gateway_clients(spec, role):
        keys_vol, keys_mount = api_keys_volume(spec.api_key_secret)
        vols, mounts = vols + [keys_vol], mounts + [keys_mount]
    if spec.lora is not None:
        lora_vols, lora_mounts = spec.lora.volumes()
        vols, mounts = vols + lora_vols, mounts + lora_mounts
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM}}
    container = {
        "name": role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["disagg"],
        "args": worker_args(spec, role, cfg),
        "env": worker_env(spec, w),
        "ports": worker_ports(role),
        "resources": worker_resources(spec, w, cfg),
        "securityContext": container_security_context(ipc_lock=spec.transfer.rdma),
        "volumeMounts": mounts + [tmp_mount, {"name": "dshm", "mountPath": "/dev/shm"}, auth_mount],
        **probes(),
        **drain_on_stop(),
    }
    pod_labels = {**role_labels(spec, role), names.REVISION_LABEL: pairing_revision(spec), **llmd_labels(role)}
    return {
        "metadata": {"labels": pod_labels},
        "spec": {
            "containers": [container],
            "volumes": vols + [tmp_vol, shm, auth_vol],
            "securityContext": pod_security_context(),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": spec.grace_period_s,
            **scheduling(spec, role, w.placement),
        },
    }


def build_worker_statefulset(
    spec: ModelSpec, role: str, cfg: OperatorConfig, partition: int = 0, surge: int = 0
) -> dict[str, Any]:
    """The StatefulSet of one worker role; pods start in parallel and are found through the headless Service.

    Pods with an ordinal at or above `partition` run the current template; the rollout planner lowers it step by
    step, and adds `surge` pods during a rollout. The template's hash is recorded so that a changed template is
    recognised as a new rollout.
    """
    name = names.child_name(spec.name, role)
    template = worker_pod_template(spec, role, cfg)
    meta = metadata(spec, name, role, role)
    meta["annotations"] = {names.TEMPLATE_HASH_ANNOTATION: template_hash(template)}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": spec.worker(role).replicas + surge,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(spec, role)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}},
            "minReadySeconds": spec.rollout.min_ready_s,
            "template": template,
        },
    }


def build_headless_service(spec: ModelSpec, role: str) -> dict[str, Any]:
    """Headless Service whose A records list the role's ready pods; the router resolves it."""
    name = names.child_name(spec.name, role)
    ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
        for p in worker_ports(role)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, name, role, role),
        "spec": {
            "clusterIP": "None",
            "selector": front_end_labels(spec, role),
            "ports": ports,
            "publishNotReadyAddresses": False,
        },
    }
