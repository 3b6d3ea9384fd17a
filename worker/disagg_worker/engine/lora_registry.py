"""The engine's side of the LoRA adapters: each name's adapter, and which adapters are resident.

Adapter i (from 1, in --lora-modules' order) is `LoraRegistry.adapter(name)`; 0 is the base model. The HTTP process
refuses an unknown name first (404 naming `model`); the engine checks again. `Resident` keeps at most --max-loras
adapters in the model's slots (`model/lora.py`): a request is admitted only once its adapter holds a slot (its
own, or one no running request uses, taken from the adapter used least recently and loaded again); until then
it waits, and those behind it need not. A request holds its slot from its admission until its pages are
released (after the last step that computes for it), so a slot is never reloaded under a forward that reads it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from disagg_worker.engine.request import Req
from disagg_worker.lora_config import LoraConfig


class LoraRegistry:
    def __init__(self, cfg: LoraConfig):
        self.adapters = {name: i for i, (name, _) in enumerate(cfg.adapters, start=1)}

    def adapter(self, name: str) -> int:
        """Adapter `name`'s number ("": the base model, 0); 0 for a name not served (refused by `problem`)."""
        return self.adapters.get(name, 0)

    def names(self, adapters: Iterable[int]) -> tuple[str, ...]:
        """The names of adapters numbered `adapters` (the base model, 0, has none), in that order."""
        by_number = {i: name for name, i in self.adapters.items()}
        return tuple(by_number[a] for a in adapters if a in by_number)

    def problem(self, name: str) -> str:
        """Why a request for adapter `name` cannot run here ("" when it can)."""
        if not name or name in self.adapters:
            return ""
        return f"LoRA adapter {name} is not served by this instance"


def adapter_names(reqs: Iterable[Req]) -> tuple[str, ...]:
    """The adapters `reqs` run under, each once, sorted (the base model is none): what /metrics reports."""
    return tuple(sorted({r.params.lora for r in reqs if r.params.lora}))


class Resident:
    """Which adapter each of `max_loras` slots holds, adapter i in slot i from the start; `load(slot, adapter)`
    copies an adapter into a slot (the model's `LoraLayers.load`)."""

    def __init__(self, max_loras: int, num_adapters: int, load: Callable[[int, int], None] = lambda s, a: None):
        self.held = {slot: slot for slot in range(1, min(max_loras, num_adapters) + 1)}  # slot -> adapter
        self.users = dict.fromkeys(self.held, 0)  # slot -> running requests under it
        self.last_used = dict.fromkeys(self.held, 0)
        self.load = load
        self._clock = itertools.count(1)

    def resident(self) -> tuple[int, ...]:
        """The adapters the slots hold, in slot order: those a request runs under without loading one."""
        return tuple(self.held[s] for s in sorted(self.held))

    def _slot_of(self, adapter: int) -> int | None:
        return next((s for s, a in self.held.items() if a == adapter), None)

    def _free_slot(self) -> int | None:
        """The slot no running request uses whose adapter was used least recently."""
        free = [s for s, n in self.users.items() if n == 0]
        return min(free, key=self.last_used.__getitem__) if free else None

    def fits(self, req: Req) -> bool:
        """Whether `req` can be admitted now: the base, a resident adapter, or a slot to load it into."""
        return not req.lora_adapter or self._slot_of(req.lora_adapter) is not None or self._free_slot() is not None

    def acquire(self, req: Req) -> None:
        """Give an admitted `req` its adapter's slot (`fits` said there is one), loading the adapter if need be."""
        if not req.lora_adapter:
            return
        slot = self._slot_of(req.lora_adapter)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire without fits"
            self.load(slot, req.lora_adapter)
            self.held[slot] = req.lora_adapter
        self.users[slot] += 1
        req.lora_slot = slot

    def release(self, req: Req) -> None:
        """`req` no longer reads its slot (its pages were released)."""
        if req.lora_slot:
            self.users[req.lora_slot] -= 1
            self.last_used[req.lora_slot] = next(self._clock)
            req.lora_slot = 0
