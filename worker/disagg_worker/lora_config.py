"""The LoRA adapters' part of the configuration chain (`config.py`: EngineConfig.lora): the adapters served
beside the base model, named as a request's `model` names them (`model/lora.py` reads and applies them)."""

from __future__ import annotations

from dataclasses import dataclass

from disagg_api import settings as S
from disagg_worker.errors import ConfigError
from disagg_worker.flags import from_flag


@dataclass(frozen=True)
class LoraConfig:
    modules: tuple[str, ...] = from_flag(S.LORA_MODULES)  # NAME=PATH, in the order given
    max_loras: int = from_flag(S.MAX_LORAS)
    max_lora_rank: int = from_flag(S.MAX_LORA_RANK)

    def __post_init__(self) -> None:
        pairs = self.adapters
        names = [name for name, _ in pairs]
        if len(set(names)) < len(names):
            raise ConfigError(f"--lora-modules: each adapter needs a name of its own, got {', '.join(names)}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank}: must be at least 1")
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras {self.max_loras}: must be at least 1")

    @property
    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each adapter, in order: adapter i + 1 (`engine/lora_registry.py`)."""
        pairs = []
        for word in self.modules:
            name, eq, path = word.partition("=")
            if not eq or not name or not path:
                raise ConfigError(f"--lora-modules {word}: expected NAME=PATH")
            pairs.append((name, path))
        return pairs

    @property
    def enabled(self) -> bool:
        return bool(self.modules)
