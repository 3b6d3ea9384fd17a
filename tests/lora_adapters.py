"""LoRA adapters made by PEFT for tests (there is no hub here): random non-zero weights, saved in PEFT's format."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
B_STD = 0.2  # PEFT starts B at zero (a no-op adapter): a trained one is not


def write_adapter(
    model_dir: str | Path, out: Path, targets: list[str], r: int = 8, alpha: int = 16, seed: int = 0, **kw
) -> Path:
    """An adapter of `model_dir` on the projections `targets`, A and B random (seeded), saved in `out`."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **kw))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, B_STD)
    peft.save_pretrained(out)
    return out


def peft_model(model_dir: str | Path, adapters: dict[str, Path]) -> PeftModel:
    """The base model with every adapter of `adapters` loaded under its name (`set_adapter` picks one)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def greedy(model, ids: list[int], n: int, adapter: str | None) -> list[int]:
    """Greedy tokens of transformers' generate under `adapter` (None: the base, adapters disabled)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        else:
            model.set_adapter(adapter)
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()
