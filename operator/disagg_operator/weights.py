"""How much local disk a worker pod needs: the Hugging Face download cache, /tmp, and what both add up to.

A model given by `huggingFaceId` without `cachePvc` downloads into an emptyDir. Its sizeLimit is `model.cacheSize`,
or else an estimate from the parameter count the id names ("Llama-3.1-8B" -> 8e9 parameters at 2 bytes each, plus
a quarter for tokenizer files and margin). The pod requests that much ephemeral storage, so the scheduler counts
it and the kubelet evicts only the pod that overran its own bound. An id that names no parameter count
("deepseek-ai/DeepSeek-V3", "microsoft/phi-4") gets no bound rather than a guessed one, which would evict the pod
in the middle of every download: the WeightsCacheAtRisk condition and a Warning event say so, and ask for
`model.cacheSize` or `model.cachePvc`. The condition also warns when a given size is below the estimate.
"""

import math
import re

from .spec import ModelSource, ModelSpec

GI = 2**30
MI = 2**20
BYTES_PER_PARAMETER = 2  # bfloat16/float16 safetensors, what model repositories ship
MARGIN = 1.25
WORKER_TMP = "4Gi"  # compile caches (triton, inductor) and scratch files
ROUTER_TMP = "256Mi"
LOGS = "1Gi"  # container logs and the writable layer, which the kubelet counts as the pod's ephemeral storage
SHM = "2Gi"  # /dev/shm (memory-backed): NCCL's and torch's inter-process buffers

_SUFFIXES = {"Ki": 2**10, "Mi": MI, "Gi": GI, "Ti": 2**40, "Pi": 2**50, "k": 10**3, "M": 10**6, "G": 10**9}
_SUFFIXES |= {"T": 10**12, "P": 10**15, "": 1}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|)$")
# "8B", "0.5B", "135M", "8x7B" (experts x size), delimited by non-alphanumerics.
_PARAMS = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BM])(?![A-Za-z0-9])", re.IGNORECASE)


def to_bytes(quantity: str) -> int:
    """A Kubernetes storage quantity ("40Gi", "500G", "1073741824") in bytes."""
    m = _QUANTITY.match(str(quantity))
    if not m:
        raise ValueError(f"not a storage quantity: {quantity!r}")
    return math.ceil(float(m.group(1)) * _SUFFIXES[m.group(2)])


def mebibytes(n: int) -> str:
    """`n` bytes as a quantity, rounded up to a whole MiB (in Gi when that is whole)."""
    mi = math.ceil(n / MI)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"


def estimated_bytes(hugging_face_id: str) -> int | None:
    """What the weights of the model an id names take on disk, from the parameter count in its name; None when
    the name says none."""
    counts = [
        int(experts or 1) * float(size) * (1e9 if unit.upper() == "B" else 1e6)
        for experts, size, unit in _PARAMS.findall(hugging_face_id.rsplit("/", 1)[-1])
    ]
    return math.ceil(max(counts) * BYTES_PER_PARAMETER * MARGIN) if counts else None


def downloads_to_emptydir(model: ModelSource) -> bool:
    return bool(model.hugging_face_id) and not model.cache_pvc


def cache_size(model: ModelSource) -> str | None:
    """The download cache emptyDir's sizeLimit; None when nothing downloads into an emptyDir or no size is known."""
    if not downloads_to_emptydir(model):
        return None
    if model.cache_size:
        return str(model.cache_size)
    estimate = estimated_bytes(model.hugging_face_id or "")
    return f"{max(1, math.ceil(estimate / GI))}Gi" if estimate else None


def worker_ephemeral_storage(model: ModelSource) -> str:
    """A worker's ephemeral storage: the download cache (when an emptyDir), /tmp and its logs."""
    cache = cache_size(model)
    return mebibytes((to_bytes(cache) if cache else 0) + to_bytes(WORKER_TMP) + to_bytes(LOGS))


def cache_condition(spec: ModelSpec) -> tuple[str, str, str]:
    """WeightsCacheAtRisk as (status, reason, message): True when the download cache may be too small."""
    m = spec.model
    if not downloads_to_emptydir(m):
        reason = "PersistentVolume" if m.hugging_face_id else "NoDownload"
        return "False", reason, "the weights are not downloaded into an emptyDir"
    size = cache_size(m)
    if size is None:
        return (
            "True",
            "SizeUnknown",
            f"{m.hugging_face_id} names no parameter count: it downloads into an unbounded emptyDir the scheduler "
            "does not count (a full disk evicts the node's pods); set model.cacheSize to the weights' size, or "
            "model.cachePvc",
        )
    estimate = estimated_bytes(m.hugging_face_id or "")
    if estimate is not None and to_bytes(size) < estimate:
        return (
            "True",
            "CacheTooSmall",
            f"model.cacheSize {size} is below the ~{mebibytes(estimate)} {m.hugging_face_id} needs: "
            "the pod is evicted when the download outgrows it",
        )
    return "False", "Bounded", f"the download cache is bounded at {size} and counted as ephemeral storage"
