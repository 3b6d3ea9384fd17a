"""API names shared by the CRD, the builders, the handlers and the chart.

Everything a user or another component can see (group, labels, ports, annotation keys, child names) is spelled
here once.
"""

GROUP = "disagg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedModel"
PLURAL = "disaggregatedmodels"
SINGULAR = "disaggregatedmodel"
SHORT_NAME = "dm"

FIELD_MANAGER = "disagg-operator"
MANAGED_BY = "disagg-operator"

# Labels. `MODEL_LABEL` and `ROLE_LABEL` select pods; the app.kubernetes.io set is for humans and tools.
MODEL_LABEL = f"{GROUP}/model"
ROLE_LABEL = f"{GROUP}/role"
# A worker pod's pairing revision: a hash of what prefill and decode must agree on (image, model, transfer, page
# size, KV dtype). The router pairs only pods of equal revision, so a rollout never mixes incompatible halves.
REVISION_LABEL = f"{GROUP}/revision"
# llm-d's labels of a model server pod (its endpoint picker and routing sidecar select by them): the P/D role
# (`prefill` / `decode`) and the engine whose protocol the pod speaks (SGLang's: the bootstrap fields in the body).
LLMD_ROLE_LABEL = "llm-d.ai/role"
LLMD_ENGINE_LABEL = "llm-d.ai/engine-type"
LLMD_ENGINE = "sglang"
# Set by the StatefulSet controller on every pod: which template revision the pod runs.
CONTROLLER_REVISION_LABEL = "controller-revision-hash"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
APP_NAME = "disagg"

# Annotations. The operator's own bookkeeping (kopf progress and diff base) lives under this prefix.
ANNOTATION_PREFIX = GROUP
# On a worker StatefulSet: the hash of the pod template last applied, so a changed template is seen as a new rollout.
TEMPLATE_HASH_ANNOTATION = f"{GROUP}/template-hash"

# LeaderWorkerSet (sigs.k8s.io/lws), which runs the instances that span nodes.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_GROUP, LWS_PLURAL = "leaderworkerset.x-k8s.io", "leaderworkersets"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# A group pod's template hash as a label (LWS reports no revisions the way a StatefulSet does).
TEMPLATE_HASH_LABEL = f"{GROUP}/template-hash"

PREFILL = "prefill"
DECODE = "decode"
ROUTER = "router"
WORKER_ROLES = (PREFILL, DECODE)
ROLES = (PREFILL, DECODE, ROUTER)
# Mooncake Store's pod (`spec.kvCache.store`): its `disagg.dev/role` label, though it serves no requests itself.
KVSTORE = "kvstore"
# The endpoint picker a Gateway API gateway asks (`spec.gateway`; `disagg epp`): its pods' role label.
EPP = "epp"

# Ports (the worker's command-line contract; `builders.ports` says which pod listens where and who may connect).
HTTP_PORT = 8000
BOOTSTRAP_PORT = 8998
CONTROL_PORT = 9000  # rank i of a pod: CONTROL_PORT + i
TRANSFER_PORT_BASE = 15000  # rank i's Mooncake ports: the window of TRANSFER_PORTS_PER_RANK from BASE + i * that
TRANSFER_PORTS_PER_RANK = 8
DIST_PORT = 29500  # where the ranks of an instance that spans pods meet (its leader pod's TCP store)
# The kvstore pod: mooncake_master's RPC and HTTP metadata service (the worker's store client assumes 8080 when
# told no metadata URL), its admin port (/health), and mooncake_client's transfer engine, held to a fixed window
# (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) so that a NetworkPolicy can open exactly it; its /health port.
KVSTORE_RPC_PORT = 50051
KVSTORE_METADATA_PORT = 8080
KVSTORE_ADMIN_PORT = 9003
KVSTORE_TRANSFER_PORTS = (17100, 17107)
KVSTORE_CLIENT_HTTP_PORT = 9300

# The Gateway API Inference Extension (`spec.gateway`): the model's InferencePool, and the HTTPRoute to it.
INFERENCE_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{INFERENCE_GROUP}/v1"
POOL_KIND, POOL_PLURAL = "InferencePool", "inferencepools"
GATEWAY_GROUP = "gateway.networking.k8s.io"
ROUTE_API_VERSION = f"{GATEWAY_GROUP}/v1"
ROUTE_KIND, ROUTE_PLURAL = "HTTPRoute", "httproutes"
# The label Istio and kgateway put on the pods they deploy for a Gateway (the Gateway API's own key).
GATEWAY_NAME_LABEL = f"{GATEWAY_GROUP}/gateway-name"

# Secrets reach pods as read-only files, only in the pods that use them.
AUTH_TOKEN_KEY = "token"  # key of the model's shared secret in its Secret
AUTH_MOUNT = "/var/run/disagg/auth"
API_KEYS_MOUNT = "/var/run/disagg/api-keys"
API_KEY_DEFAULT_KEY = "api-key"
# Read by the worker's env module: the pod's name and pairing revision, from the downward API.
POD_NAME_ENV = "DISAGG_POD_NAME"
REVISION_ENV = "DISAGG_REVISION"

# Pod shutdown: the preStop hook sleeps while Services and the router drop the pod, then SIGTERM starts the drain
# (`--drain-timeout`); the grace period covers both plus the time the process needs to exit.
PRESTOP_SLEEP_SECONDS = 5
EXIT_MARGIN_SECONDS = 5

WORKER_UID = 1000
MODEL_MOUNT = "/models"
# Models built into the worker image (Dockerfile.worker), by the name `spec.model.builtin` gives them.
BUILTIN_MODELS = {"smollm2": "/opt/models/SmolLM2-135M-Instruct"}
HF_CACHE_MOUNT = "/cache/huggingface"
# Where each LoRA adapter of `spec.lora` is mounted in a worker pod: LORA_MOUNT/NAME.
LORA_MOUNT = "/lora"

# Condition types.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
PAIRING_VERIFIED = "PairingVerified"
HANDOFF_STALLED = "HandoffStalled"
WEIGHTS_CACHE_AT_RISK = "WeightsCacheAtRisk"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, PAIRING_VERIFIED, HANDOFF_STALLED, WEIGHTS_CACHE_AT_RISK)

# The per-role scaling object (a scale subresource an HPA can drive) for prefill.
SCALER_KIND = "RoleScaler"
SCALER_PLURAL = "rolescalers"
SCALER_SINGULAR = "rolescaler"

MAX_NAME_LENGTH = 40
# With a role whose instances span nodes: LWS names a group's worker StatefulSet `<cr>-<role>-group-<i>`, and the
# StatefulSet controller labels its pods `controller-revision-hash: <that>-<hash of up to 10>` (63 at most).
MAX_NAME_LENGTH_GROUPS = 34


def child_name(cr_name: str, suffix: str) -> str:
    """The name of a child object: `<cr>-<suffix>` (e.g. `llama-prefill`)."""
    return f"{cr_name}-{suffix}"


def group_set_name(cr_name: str, role: str) -> str:
    """The LeaderWorkerSet of a role whose instances span nodes (`<cr>-decode-group`): its pods are
    `<cr>-decode-group-<instance>` (the leader) and `...-<instance>-<pod>`, and LWS names its own headless Service
    (the leaders' addresses, not-ready ones included) after it."""
    return child_name(cr_name, f"{role}-group")


def epp_name(cr_name: str) -> str:
    """The endpoint picker's Deployment, Service, ServiceAccount and NetworkPolicy."""
    return child_name(cr_name, EPP)


def gateway_policy_name(cr_name: str) -> str:
    """The NetworkPolicy that admits the gateway (and the picker) to the pool's pods."""
    return child_name(cr_name, "gateway")


def handoff_policy_name(cr_name: str) -> str:
    """The NetworkPolicy that admits the decode pods (their hand-off) and the picker to the prefill pods' HTTP port."""
    return child_name(cr_name, "gateway-prefill")


def auth_secret_name(cr_name: str) -> str:
    return child_name(cr_name, "auth")


def bootstrap_service_name(cr_name: str) -> str:
    return child_name(cr_name, "bootstrap")


def network_policy_name(cr_name: str, role: str) -> str:
    """The NetworkPolicy of one role's pods (`<cr>-prefill`, ...)."""
    return child_name(cr_name, role)
