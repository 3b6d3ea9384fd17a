"""Rotary position embedding, Hugging Face convention (rotate-half, or interleaved pairs as DeepSeek's
MLA weights use), with Llama-3, linear and YaRN scaling (YaRN also scales cos/sin by its attention factor)."""

from __future__ import annotations

import math

import torch
from torch import nn

from disagg_worker.model.config import ModelConfig, yarn_mscale


def inv_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rope_dim / 2] float32 inverse frequencies, scaled as `cfg.rope_scaling` asks."""
    dim = cfg.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_scaled(inv_freq, scaling, dim, cfg.rope_theta, cfg.max_position_embeddings)
    return _llama3_scaled(inv_freq, scaling)


def attention_factor(cfg: ModelConfig) -> float:
    """What cos/sin are multiplied by: 1, or YaRN's mscale ratio."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all_dim = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_scaled(inv_freq: torch.Tensor, s: dict, dim: int, base: float, max_pos: int) -> torch.Tensor:
    """YaRN: high frequencies kept, low ones divided by `factor`, a linear ramp between the dimensions
    that turn `beta_fast` and `beta_slow` times over the original context."""
    old_len = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / old_len

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_position_embeddings-1, computed once in float32."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq = inv_frequencies(cfg, device)
        positions = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(cfg)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of tokens at `positions`, in `dtype`: looked up once per forward, applied by every layer."""
        return Rotation(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


class Rotation:
    """cos/sin [T, 1, D] of one forward's tokens."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, H_kv, D] by their token's position (on CUDA in one Triton kernel,
        `triton_fused.rope`, rounding as here)."""
        cos, sin = self.cos, self.sin
        fused = q.dtype in (torch.float32, torch.bfloat16)  # what `triton_fused` rounds as torch does
        if q.is_cuda and fused and k.dtype == q.dtype == cos.dtype and q.shape[-1] == k.shape[-1] == cos.shape[-1]:
            from disagg_worker.model.triton_fused import rope

            return rope(q, k, cos, sin)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def interleaved(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same rotation of pairs (x0, x1), (x2, x3)...; the result comes out de-interleaved
        (evens' rotation, then odds'), as DeepSeek's reference lays it out."""
        half = self.cos.shape[-1] // 2
        cos, sin = self.cos[..., :half], self.sin[..., :half]

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        return rot(q), rot(k)
