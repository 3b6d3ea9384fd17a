"""The engine settings a DisaggregatedModel sets, in `spec.engine` and in each role's `engine` block over it.

Each is one of the worker's settings (`disagg_api.settings`: its flag, type and meaning) under its CRD field, with
the CRD's default (a cluster's, not the engine's own: bfloat16 and a larger cache) and the schema's description.
The CRD's engine block (`crd_roles.engine_props`), the spec's view of it (`spec.EngineSpec`) and the workers' flags
(`builders.workers`) are all made from `ENGINE_FIELDS`, in its order, which is the order of the flags on a worker's
command line: a new field goes last, since a reordered command line rolls every existing model's pods.
"""

from dataclasses import dataclass
from typing import Any

from disagg_api import settings as S
from disagg_api.setting import Setting

from .schema import integer, string

# One list for every dtype field: the CRD's YAML spells it once (an anchor) and refers to it after.
DTYPES = list(S.DTYPES)


@dataclass(frozen=True)
class EngineField:
    """One setting of the engine block: integers are at least 1, strings one of `values`."""

    name: str
    setting: Setting
    default: int | str
    doc: str
    values: list[str] | None = None

    def schema(self, with_default: bool) -> dict[str, Any]:
        """The field's schema node, with the CRD's default in `spec.engine` (a role's block inherits it)."""
        if self.setting.type is int:
            return integer(int(self.default) if with_default else None, 1, self.doc)
        extra = {"enum": self.values} if self.values else {}
        return string(self.doc, 16, **extra, **({"default": self.default} if with_default else {}))


ENGINE_FIELDS = (
    EngineField("pageSize", S.PAGE_SIZE, 16, "Tokens per KV page; prefill and decode must agree."),
    EngineField("kvDtype", S.KV_DTYPE, "bfloat16", "KV cache dtype; prefill and decode must agree.", DTYPES),
    EngineField("dtype", S.DTYPE, "bfloat16", "Model weights dtype.", DTYPES),
    EngineField("chunkSize", S.CHUNK_SIZE, 4096, "Chunked-prefill size in tokens."),
    EngineField("maxTotalTokens", S.MAX_TOTAL_TOKENS, 65536, "KV cache capacity in tokens."),
    EngineField("maxRunningRequests", S.MAX_RUNNING_REQUESTS, 64, "Requests running at once."),
)
DEFAULT_ENGINE: dict[str, Any] = {f.name: f.default for f in ENGINE_FIELDS}
