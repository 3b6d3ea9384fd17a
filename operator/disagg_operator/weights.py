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

from .quantity import GI, mebibytes, to_bytes
from .spec import ModelSource, ModelSpec

BYTES_PER_PARAMETER = 2  # bfloat16/float16 safetensors, what model repositories ship
MARGIN = 1.25
WORKER_TMP = "4Gi"  # compile caches (triton, inductor) and scratch files
ROUTER_TMP = "256Mi"
LOGS = "1Gi"  # container logs and the writable layer, which the kubelet counts as the pod's ephemeral storage
SHM = "2Gi"  # /dev/shm (memory-backed): NCCL's and torch's inter-process buffers

# "8B", "0.5B", "135M", "8x7B" (experts x size), delimited by non-alphanumerics.
_PARAMS = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BM])(?![A-Za-z0-9])", re.IGNORECASE)


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
