"""A typed, read-only view of a DisaggregatedModel's spec.

The CRD's structural schema fills in defaults on the API server; `ModelSpec.from_cr` applies the same defaults so
that builders see the same values for a CR read from the server and for a hand-written dict in a test.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from disagg_api import settings as S
from disagg_api.setting import Setting

from . import names
from .engine_fields import DEFAULT_ENGINE, ENGINE_FIELDS
from .flow_spec import FlowControlSpec
from .gateway_spec import GatewaySpec
from .kvcache import KVCacheSpec
from .lora_spec import LoraSpec

DEFAULT_DRAIN_TIMEOUT = 30
DEFAULT_PROGRESS_DEADLINE = 600
DEFAULT_MAX_SURGE = 1  # one pod per role: a rollout starts a new pair before an old pod leaves
ORDERS = {"DecodeFirst": (names.DECODE, names.PREFILL), "PrefillFirst": (names.PREFILL, names.DECODE)}
# Label keys the operator sets itself: a CR's own value for one of them is not copied to its children.
OPERATOR_LABEL_KEYS = frozenset(
    {names.LABEL_NAME, names.LABEL_INSTANCE, names.LABEL_COMPONENT, names.LABEL_PART_OF, names.LABEL_MANAGED_BY}
)


@dataclass(frozen=True)
class EngineSpec:
    """A role's engine settings (`engine_fields.ENGINE_FIELDS`), by CRD field."""

    values: Mapping[str, Any]

    @classmethod
    def merged(cls, shared: Mapping[str, Any], override: Mapping[str, Any]) -> "EngineSpec":
        """The role's engine settings: the role's `engine` block over the CR's `engine` block over defaults."""
        v = {**DEFAULT_ENGINE, **shared, **override}
        return cls({f.name: v[f.name] for f in ENGINE_FIELDS})

    @property
    def page_size(self) -> int:
        return self.values["pageSize"]

    @property
    def kv_dtype(self) -> str:
        return self.values["kvDtype"]

    def settings(self) -> list[tuple[Setting, Any]]:
        """Each worker setting with its value, in the order of `ENGINE_FIELDS`."""
        return [(f.setting, self.values[f.name]) for f in ENGINE_FIELDS]


@dataclass(frozen=True)
class Resources:
    requests: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Any] = field(default_factory=dict)
    gpus: int = 0
    rdma: int = 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Resources":
        return cls(dict(d.get("requests", {})), dict(d.get("limits", {})), int(d.get("gpus", 0)), int(d.get("rdma", 1)))


@dataclass(frozen=True)
class Placement:
    """Where and how a role's pods run: scheduling constraints and the user's extra env and args."""

    resources: Resources
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    env: tuple[Mapping[str, Any], ...]
    args: tuple[str, ...]
    # None: the operator's default spread (builders/placement.py); an empty tuple: none at all.
    spread: tuple[Mapping[str, Any], ...] | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        spread = d.get("topologySpreadConstraints")
        return cls(
            Resources.from_dict(d.get("resources", {})),
            dict(d.get("nodeSelector", {})),
            tuple(d.get("tolerations", ())),
            dict(d.get("affinity", {})),
            tuple(d.get("env", ())),
            tuple(str(a) for a in d.get("args", ())),
            tuple(spread) if spread is not None else None,
        )


@dataclass(frozen=True)
class WorkerRoleSpec:
    role: str
    replicas: int
    tp_size: int
    pp_size: int
    engine: EngineSpec
    placement: Placement
    ep_size: int = 1
    dp_attention: bool = False
    dp_size: int = 1
    prefix_cache: bool = False  # decode only: keep finished requests' KV (`--decode-prefix-cache`)
    # Ranks one node runs (its GPUs): an instance of more ranks spans `nodes` pods, run by a LeaderWorkerSet.
    gpus_per_node: int = 8

    @property
    def ranks(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def nodes(self) -> int:
        """Pods one instance spans (1: a pod of a StatefulSet; more: a group of a LeaderWorkerSet)."""
        return self.ranks // self.gpus_per_node if self.ranks > self.gpus_per_node else 1

    @property
    def ranks_per_pod(self) -> int:
        return self.ranks // self.nodes


@dataclass(frozen=True)
class RouterSpec:
    replicas: int
    policy: str
    placement: Placement
    # cache_aware: a decode lacking at most this many prompt tokens computes them itself (0: never).
    decode_only_tokens: int = 0
    # Times a stream whose decode fails migrates to another pair; None: the router's default.
    migration_limit: int | None = None
    flow_control: FlowControlSpec = field(default_factory=FlowControlSpec)  # off: no `--flow-*` flag


@dataclass(frozen=True)
class TracingSpec:
    """OpenTelemetry traces of each request (`spec.tracing`): where the router and the workers send their spans."""

    otlp_endpoint: str
    sampling_ratio: float = 1.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "TracingSpec | None":
        return cls(d["otlpEndpoint"], float(d.get("samplingRatio", 1.0))) if d else None


@dataclass(frozen=True)
class ModelSource:
    path: str | None
    pvc: str | None
    host_path: str | None
    hugging_face_id: str | None
    cache_pvc: str | None
    cache_size: str | None = None  # the download cache's emptyDir size; None: see weights.py
    builtin: str | None = None  # a model inside the worker image (names.BUILTIN_MODELS)

    @property
    def model_arg(self) -> str:
        """What `--model` receives: the directory inside the mounted volume, the Hugging Face id, or the
        built-in model's directory in the image."""
        if self.builtin:
            return names.BUILTIN_MODELS[self.builtin]
        if self.hugging_face_id:
            return self.hugging_face_id
        path = (self.path or "").lstrip("/")
        return f"{names.MODEL_MOUNT}/{path}".rstrip("/")


@dataclass(frozen=True)
class TransferSpec:
    backend: str
    protocol: str
    ib_device: str | None

    @property
    def rdma(self) -> bool:
        return self.protocol == "rdma"


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding, the same settings for both roles: decode drafts; with a draft model prefill runs it
    over the prompt and sends its KV (NGRAM needs nothing from prefill)."""

    algorithm: str
    num_draft_tokens: int = 8
    ngram_min_match: int = 2
    ngram_max_match: int = 8
    num_steps: int = 3
    draft_model_path: str | None = None  # inside the model's volume; EAGLE and STANDALONE only

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "SpeculativeSpec | None":
        if not d:
            return None
        return cls(
            str(d["algorithm"]),
            int(d.get("numDraftTokens", 8)),
            int(d.get("ngramMinMatchWindowSize", 2)),
            int(d.get("ngramMaxMatchWindowSize", 8)),
            int(d.get("numSteps", 3)),
            d.get("draftModelPath"),
        )

    @property
    def draft_arg(self) -> str | None:
        """What `--speculative-draft-model-path` receives: the draft's directory in the mounted model volume."""
        if not self.draft_model_path:
            return None
        return f"{names.MODEL_MOUNT}/{self.draft_model_path.lstrip('/')}".rstrip("/")

    def settings(self) -> list[tuple[Setting, Any]]:
        """The worker settings of the algorithm: its draft model's, or NGRAM's."""
        if self.draft_arg is not None:
            return [
                (S.SPECULATIVE_ALGORITHM, self.algorithm),
                (S.SPECULATIVE_DRAFT_MODEL_PATH, self.draft_arg),
                (S.SPECULATIVE_NUM_STEPS, self.num_steps),
            ]
        return [
            (S.SPECULATIVE_ALGORITHM, self.algorithm),
            (S.SPECULATIVE_NUM_DRAFT_TOKENS, self.num_draft_tokens),
            (S.SPECULATIVE_NGRAM_MIN_MATCH_WINDOW_SIZE, self.ngram_min_match),
            (S.SPECULATIVE_NGRAM_MAX_MATCH_WINDOW_SIZE, self.ngram_max_match),
        ]


@dataclass(frozen=True)
class RolloutSpec:
    """How a change of the worker pods rolls out: beside the old pods or in place, in which order (rollout.py)."""

    order: tuple[str, str] = ORDERS["DecodeFirst"]
    max_skew_percent: int | None = None  # None: one pod's worth
    progress_deadline_s: int = DEFAULT_PROGRESS_DEADLINE
    min_ready_s: int = 0
    max_surge: int = DEFAULT_MAX_SURGE  # pods per role started beside the old ones; 0 rolls in place

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RolloutSpec":
        skew = d.get("maxSkew")
        return cls(
            ORDERS[d.get("order", "DecodeFirst")],
            int(str(skew).rstrip("%")) if skew is not None else None,
            int(d.get("progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE)),
            int(d.get("minReadySeconds", 0)),
            int(d.get("maxSurge", DEFAULT_MAX_SURGE)),
        )


def prefill_for_decode(decode_replicas: int, ratio: float) -> int:
    """Prefill replicas that keep `ratio` prefill pods per decode pod: rounded up, at least one (none for none)."""
    if decode_replicas <= 0:
        return 0
    return max(1, math.ceil(decode_replicas * ratio - 1e-9))


def user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The CR's labels that its children and pods carry too: all but the operator's own keys."""
    return {k: v for k, v in labels.items() if k not in OPERATOR_LABEL_KEYS and not k.startswith(f"{names.GROUP}/")}


@dataclass(frozen=True)
class SecretRef:
    """A key of a Secret in the model's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class ModelSpec:
    """Everything the builders need from one DisaggregatedModel."""

    name: str
    namespace: str
    uid: str
    image: str
    image_pull_policy: str
    served_model_name: str
    model: ModelSource
    transfer: TransferSpec
    prefill: WorkerRoleSpec
    decode: WorkerRoleSpec
    router: RouterSpec
    auth_secret: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    drain_timeout_s: int = DEFAULT_DRAIN_TIMEOUT
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    # Prefill pods per decode pod; when set, prefill's replicas follow decode's (spec.prefill.replicas is ignored).
    prefill_per_decode: float | None = None
    # The clients' API keys (a file of keys, one a line), mounted into the router only; None: no API keys.
    api_key_secret: SecretRef | None = None
    speculative: SpeculativeSpec | None = None  # None: no speculative decoding
    tracing: TracingSpec | None = None  # None: no traces
    kv_cache: KVCacheSpec | None = None  # None: no host tier, no store
    gateway: GatewaySpec | None = None  # None: no InferencePool, no endpoint picker
    lora: LoraSpec | None = None  # None: no LoRA adapters
    # The SLO planner runs (spec.scaling.planner, Advisory or Apply): the operator reads the workers' /metrics.
    planned: bool = False

    @property
    def grace_period_s(self) -> int:
        """terminationGracePeriodSeconds: the preStop sleep, the drain, and the process's exit."""
        return names.PRESTOP_SLEEP_SECONDS + self.drain_timeout_s + names.EXIT_MARGIN_SECONDS

    @property
    def auth_secret_name(self) -> str:
        return self.auth_secret or names.auth_secret_name(self.name)

    def worker(self, role: str) -> WorkerRoleSpec:
        return self.prefill if role == names.PREFILL else self.decode

    def replicas(self, role: str) -> int:
        return self.router.replicas if role == names.ROUTER else self.worker(role).replicas

    @classmethod
    def from_cr(cls, cr: Mapping[str, Any]) -> "ModelSpec":
        meta, spec = cr["metadata"], cr.get("spec", {})
        engine = spec.get("engine", {})
        model = spec.get("model", {})
        transfer = spec.get("transfer", {})
        router = spec.get("router", {})
        ratio = spec.get("scaling", {}).get("prefillPerDecode")
        decode = _worker_role(names.DECODE, spec.get("decode", {}), engine)
        prefill = _worker_role(names.PREFILL, spec.get("prefill", {}), engine)
        if ratio is not None:
            prefill = replace(prefill, replicas=prefill_for_decode(decode.replicas, float(ratio)))
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace", "default"),
            uid=meta.get("uid", ""),
            image=spec["image"],
            image_pull_policy=spec.get("imagePullPolicy", "IfNotPresent"),
            served_model_name=spec.get("servedModelName") or meta["name"],
            model=ModelSource(
                model.get("path"),
                model.get("pvc"),
                model.get("hostPath"),
                model.get("huggingFaceId"),
                model.get("cachePvc"),
                model.get("cacheSize"),
                model.get("builtin"),
            ),
            transfer=TransferSpec(
                transfer.get("backend", "mooncake"), transfer.get("protocol", "tcp"), transfer.get("ibDevice")
            ),
            prefill=prefill,
            decode=decode,
            router=RouterSpec(
                int(router.get("replicas", 1)),
                router.get("policy", "round_robin"),
                Placement.from_dict(router),
                int(router.get("decodeOnlyTokens", 0)),
                None if router.get("migrationLimit") is None else int(router["migrationLimit"]),
                FlowControlSpec.from_dict(router.get("flowControl")),
            ),
            auth_secret=spec.get("auth", {}).get("secretName"),
            labels=user_labels(meta.get("labels") or {}),
            drain_timeout_s=int(spec.get("drain", {}).get("timeoutSeconds", DEFAULT_DRAIN_TIMEOUT)),
            rollout=RolloutSpec.from_dict(spec.get("rollout", {})),
            prefill_per_decode=float(ratio) if ratio is not None else None,
            api_key_secret=_secret_ref(spec.get("apiKeySecret")),
            speculative=SpeculativeSpec.from_dict(spec.get("speculative")),
            tracing=TracingSpec.from_dict(spec.get("tracing")),
            kv_cache=KVCacheSpec.from_dict(spec.get("kvCache")),
            gateway=GatewaySpec.from_dict(spec.get("gateway"), Placement.from_dict(spec.get("gateway") or {})),
            planned=_planned(spec.get("scaling") or {}),
            lora=LoraSpec.from_dict(spec.get("lora")),
        )


def _planned(scaling: Mapping[str, Any]) -> bool:
    """As planner/from_cr.planner_spec decides: a planner not Off, with its target."""
    planner = scaling.get("planner")
    return planner is not None and "slo" in scaling and planner.get("mode", "Advisory") != "Off"


def _secret_ref(d: Mapping[str, Any] | None) -> SecretRef | None:
    if not d:
        return None
    return SecretRef(d["name"], d.get("key", names.API_KEY_DEFAULT_KEY))


def _worker_role(role: str, d: Mapping[str, Any], shared_engine: Mapping[str, Any]) -> WorkerRoleSpec:
    return WorkerRoleSpec(
        role,
        int(d.get("replicas", 1)),
        int(d.get("tpSize", 1)),
        int(d.get("ppSize", 1)),
        EngineSpec.merged(shared_engine, d.get("engine", {})),
        Placement.from_dict(d),
        int(d.get("epSize", 1)),
        bool(d.get("enableDpAttention", False)),
        int(d.get("dpSize", 1)),
        bool(d.get("prefixCache", False)),
        int(d.get("gpusPerNode", 8)),
    )
