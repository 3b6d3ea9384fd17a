"""Which module builds each supported architecture (`ModelConfig.arch`, read from `config.json` or a
GGUF file): its attention, and whether its layers' MLPs are dense or MoE (`cfg.moe` says which layers).

- llama, mistral, qwen2, qwen3: grouped-query attention (`llama.py`), dense MLPs;
- qwen3_moe: the same attention with per-head q/k norm, softmax-routed experts (`moe.py`);
- deepseek_v3: multi-head latent attention (`mla.py`), sigmoid grouped routing with shared experts,
  the first `first_k_dense_replace` layers dense.
"""

from __future__ import annotations

from disagg_worker.model import llama, mla
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.decoder import Blocks, CausalLM, Collectives
from disagg_worker.model.parallel import Shard

ARCHITECTURES: dict[str, Blocks] = {
    "llama": llama.BLOCKS,
    "mistral": llama.BLOCKS,
    "qwen2": llama.BLOCKS,
    "qwen3": llama.BLOCKS,
    "qwen3_moe": llama.BLOCKS,
    "deepseek_v3": Blocks(attention=mla.MLAttention),
}


def build_model(cfg: ModelConfig, shard: Shard | None = None, comm: Collectives | None = None) -> CausalLM:
    """The model of `cfg.arch` (this rank's `shard` of it, talking to the other ranks through `comm`), with
    uninitialised weights."""
    if cfg.arch not in ARCHITECTURES:
        raise ValueError(f"no model module for architecture {cfg.arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return CausalLM(cfg, ARCHITECTURES[cfg.arch], shard, comm)
