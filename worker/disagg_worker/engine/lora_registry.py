"""The engine's side of the LoRA adapters: which slot of the model's (`model/lora.py`) each adapter's name holds.

Every adapter of --lora-modules is resident from start-up, adapter i (from 1, in the order given) in slot i; slot 0
is the base model. The HTTP process refuses an unknown name first (404 naming `model`); the engine checks again.
"""

from __future__ import annotations

from disagg_worker.lora_config import LoraConfig


class LoraRegistry:
    def __init__(self, cfg: LoraConfig):
        self.slots = {name: slot for slot, (name, _) in enumerate(cfg.adapters, start=1)}

    def slot(self, name: str) -> int:
        """The slot of adapter `name` ("": the base model's, 0); 0 for a name not served (refused by `problem`)."""
        return self.slots.get(name, 0)

    def problem(self, name: str) -> str:
        """Why a request for adapter `name` cannot run here ("" when it can)."""
        if not name or name in self.slots:
            return ""
        return f"LoRA adapter {name} is not served by this instance"
