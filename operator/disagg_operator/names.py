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
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
APP_NAME = "disagg"

# Annotations. The operator's own bookkeeping (kopf progress and diff base) lives under this prefix.
ANNOTATION_PREFIX = GROUP

PREFILL = "prefill"
DECODE = "decode"
ROUTER = "router"
WORKER_ROLES = (PREFILL, DECODE)
ROLES = (PREFILL, DECODE, ROUTER)

# Ports (the worker's command-line contract; `builders.ports` says which pod listens where and who may connect).
HTTP_PORT = 8000
BOOTSTRAP_PORT = 8998
CONTROL_PORT = 9000  # rank i of a pod: CONTROL_PORT + i
TRANSFER_PORT_BASE = 15000  # rank i's Mooncake ports: the window of TRANSFER_PORTS_PER_RANK from BASE + i * that
TRANSFER_PORTS_PER_RANK = 8

# Secrets reach pods as read-only files, only in the pods that use them.
AUTH_TOKEN_KEY = "token"  # key of the model's shared secret in its Secret
AUTH_MOUNT = "/var/run/disagg/auth"
API_KEYS_MOUNT = "/var/run/disagg/api-keys"
API_KEY_DEFAULT_KEY = "api-key"

WORKER_UID = 1000
MODEL_MOUNT = "/models"
HF_CACHE_MOUNT = "/cache/huggingface"

# Condition types.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)

MAX_NAME_LENGTH = 40


def child_name(cr_name: str, suffix: str) -> str:
    """The name of a child object: `<cr>-<suffix>` (e.g. `llama-prefill`)."""
    return f"{cr_name}-{suffix}"


def auth_secret_name(cr_name: str) -> str:
    return child_name(cr_name, "auth")


def bootstrap_service_name(cr_name: str) -> str:
    return child_name(cr_name, "bootstrap")


def network_policy_name(cr_name: str, role: str) -> str:
    """The NetworkPolicy of one role's pods (`<cr>-prefill`, ...)."""
    return child_name(cr_name, role)
