"""The EAGLE draft head: one Llama decoder layer that predicts the target's next hidden state from the
target's hidden state at a position and the embedding of the token that follows it.

Checkpoint layout (SGLang's `LlamaForCausalLMEagle`, the EAGLE authors' format): `config.json` of a
one-layer Llama (`architectures: ["LlamaForCausalLMEagle"]`) and safetensors with `fc.weight`/`fc.bias`
(2 x hidden -> hidden) and `layers.0.*` without `input_layernorm`; `embed_tokens.weight` and
`lm_head.weight`, when present, are ignored: the head shares the target's embedding and LM head, as SGLang
does. The layer's output goes to the LM head without a final norm.

Draft position i reads (token i+1, target hidden state i) and writes its KV at position i; its output is
both the draft's next token (through the LM head) and the hidden state the next draft position reads in
place of the target's (`engine/drafting.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from disagg_worker.model.attention import AttentionPlan
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.decoder import CausalLM
from disagg_worker.model.layers import GatedMLP, KVCacheView, RMSNorm
from disagg_worker.model.llama import LlamaAttention
from disagg_worker.model.loader import WeightMismatchError, weight_files
from disagg_worker.model.parallel import Shard
from disagg_worker.model.rope import RotaryEmbedding, Rotation

ARCHITECTURE = "LlamaForCausalLMEagle"
_SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's are used


class EagleLayer(nn.Module):
    """A Llama decoder layer whose input is not normed (the fc output goes straight to attention)."""

    def __init__(self, cfg: ModelConfig, pool_layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, pool_layer, Shard(), lambda x: x)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rotation: Rotation, plan: AttentionPlan, kv: KVCacheView) -> torch.Tensor:
        h = h + self.self_attn(h, rotation, plan, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, pool_layer: int):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleDict({"0": EagleLayer(cfg, pool_layer)})
        self.rotary = RotaryEmbedding(cfg, device="cpu")
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None

    def share(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Use the target's embedding and LM head (not registered as this module's parameters)."""
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: KVCacheView, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's output hidden states [T, hidden] for the batch's tokens, each read with the hidden
        state of the position before it (`hidden`, [T, hidden])."""
        assert self.embed_tokens is not None
        device = self.fc.weight.device
        batch = batch.to(device)
        plan = AttentionPlan.build(batch, device, kv.page_size)
        e = self.embed_tokens(batch.input_ids)
        h = self.fc(torch.cat((e, hidden.to(device=e.device, dtype=e.dtype)), dim=-1))
        rotation = self.rotary.at(batch.positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, rotation, plan, kv)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        return self.lm_head(h).float()


def read_config(path: str | Path) -> ModelConfig:
    """The head's config: a one-layer Llama; anything else is an error naming what was found."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path}: no config.json (an EAGLE head is a directory in SGLang's EAGLE layout)")
    d = json.loads(config.read_text(encoding="utf-8"))
    archs = d.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ValueError(f"{path}: architectures {archs} is not an EAGLE head ({ARCHITECTURE})")
    if d.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: an EAGLE head has one layer, not {d['num_hidden_layers']}")
    return ModelConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def load_eagle(path: str | Path, target: CausalLM, dtype: torch.dtype, device: str, pool_layer: int) -> EagleHead:
    """The head at `path`, sharing `target`'s embedding and LM head, its KV in layer `pool_layer` of the pool."""
    cfg = read_config(path)
    with torch.device("meta"):
        head = EagleHead(cfg, pool_layer)
    expected = {name for name, _ in head.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    found: set[str] = set()
    for file in weight_files(Path(path)):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                found.add(name)
                if name in expected:
                    state[name] = f.get_tensor(name).to(dtype)
    missing, unexpected = sorted(expected - found), sorted(found - expected - set(_SHARED))
    if missing or unexpected:
        raise WeightMismatchError(
            f"{path} is not an EAGLE head: missing tensors {missing}, unexpected tensors {unexpected}"
        )
    head.load_state_dict(state, strict=False, assign=True)  # names were checked; rotary tables are built
    head = head.to(device).eval().requires_grad_(False)
    head.share(target.model.embed_tokens, target.lm_head)
    return head


def make_eagle_head(target_path: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight EAGLE head shaped for the model at `target_path` (tests and benchmarks: no
    trained head can be downloaded here; its drafts are rarely accepted, and answers stay exact)."""
    from safetensors.torch import save_file

    from disagg_worker.model.loader import model_config
    from disagg_worker.model.tiny import WEIGHT_STD

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = head_config(model_config(target_path))
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in EagleHead(read_config(out), 0).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen) * WEIGHT_STD
        weights[name] = (1.0 + noise) if "norm" in name else noise
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def head_config(target: ModelConfig) -> dict:
    """The `config.json` of an EAGLE head for `target` (its shape, one layer)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": target.rope_theta,
        **({"rope_scaling": target.rope_scaling} if target.rope_scaling else {}),
        "rms_norm_eps": target.rms_norm_eps,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
