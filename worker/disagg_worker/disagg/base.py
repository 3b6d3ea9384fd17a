"""The KV transfer contract: what the prefill and decode schedulers see.

Prefill: `mgr.create_sender(room)` when a request arrives; poll it until WaitingForInput
(decode sent its destination pages), then `send(pages, last, aux)` after each prefill chunk;
poll until Success or Failed. Decode: `mgr.create_receiver(room, bootstrap_addr)`; after it
leaves Bootstrapping call `init(dest_pages, aux_slot)`; poll until Success, then read
`aux_bytes()`. `abort()` on either side fails the other side's handle too.

Backends implement `KVManager` and are listed in `backends.BACKENDS`; handles never block.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.disagg.poll import KVPoll, StatusCell
from disagg_worker.mem.kv_pool import KVKind
from disagg_worker.request.params import MAX_LOGPROBS

if TYPE_CHECKING:
    from disagg_worker.disagg.layerwise import LayerStream

log = logging.getLogger(__name__)

# The first token, its logprob, and the tag of the LoRA adapter the prompt was computed under (`adapter_tag`).
_FIRST_TOKEN = struct.Struct("<qdQ")
_TOP_COUNT = struct.Struct("<I")
_TOP_ENTRY = struct.Struct("<qd")
# The aux record of the most a request can ask for: its first token, logprob and MAX_LOGPROBS alternatives.
AUX_ITEM_NBYTES = _FIRST_TOKEN.size + _TOP_COUNT.size + MAX_LOGPROBS * _TOP_ENTRY.size


@dataclass(frozen=True)
class KVLayout:
    """Where a KV pool lives. Buffer order is KVPool.buffers(): K of each layer, then V (`kind` MHA);
    the latent of each layer (MLA, one buffer per layer whose single "head" every TP rank holds).

    Page `p` of buffer `b` is the byte range `[buffer_ptrs[b] + p * page_nbytes, +page_nbytes)`,
    laid out `[page_size, num_kv_heads, head_nbytes]`: token by token, each token's heads side by side.
    `start_layer` is the first model layer this rank holds (pipeline parallelism); `kv_head_start`
    the global id of its first KV head (tensor parallelism: this rank holds KV heads
    `[kv_head_start, kv_head_start + num_kv_heads)`; replicated heads are held by several ranks).
    The aux region has `aux_num_slots` slots of `aux_item_nbytes` bytes (decode side).
    """

    buffer_ptrs: list[int]
    buffer_nbytes: list[int]
    page_nbytes: int
    page_size: int
    kv_dtype: str
    num_pages: int
    start_layer: int = 0
    aux_num_slots: int = 256
    aux_item_nbytes: int = AUX_ITEM_NBYTES
    kv_head_start: int = 0
    num_kv_heads: int = 1
    kind: KVKind = KVKind.MHA
    # A draft model's KV kept after the model's layers (EAGLE/STANDALONE speculation), named so that both
    # sides of a transfer check they hold the same: "" for none.
    draft_kv: str = ""
    # How many of the last layers are the draft model's (written after the model's forward, never streamed).
    draft_layers: int = 0
    # The buffers themselves as flat uint8 tensors on the pool's device (`from_pool`), for gathering and
    # scattering staged or head-sliced pages with tensor operations there; () for a layout made of addresses.
    buffers: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        per_layer = self.kind.buffers_per_layer
        if len(self.buffer_ptrs) != len(self.buffer_nbytes) or len(self.buffer_ptrs) % per_layer:
            raise ValueError(f"need {per_layer} buffer(s) per layer ({self.kind.value} KV), with a size each")
        if any(n < self.num_pages * self.page_nbytes for n in self.buffer_nbytes):
            raise ValueError("a buffer is smaller than num_pages * page_nbytes")
        if self.kv_head_start < 0 or self.num_kv_heads < 1 or self.page_nbytes % (self.page_size * self.num_kv_heads):
            raise ValueError(
                f"KV heads [{self.kv_head_start}, +{self.num_kv_heads}) do not split a page of "
                f"{self.page_nbytes} bytes into {self.page_size} tokens"
            )

    @property
    def num_layers(self) -> int:
        return len(self.buffer_ptrs) // self.kind.buffers_per_layer

    @property
    def model_layers(self) -> int:
        """The layers the model's forward computes here (those a layer-wise stream sends)."""
        return self.num_layers - self.draft_layers

    @property
    def head_nbytes(self) -> int:
        """Bytes of one KV head of one token (head_dim x element size)."""
        return self.page_nbytes // (self.page_size * self.num_kv_heads)

    @property
    def kv_heads(self) -> range:
        """The global ids of the KV heads this rank holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @classmethod
    def from_pool(cls, pool, kv_dtype: str, start_layer: int = 0, kv_heads: range | None = None, **aux) -> KVLayout:
        """Describe a `disagg_worker.mem.kv_pool.KVPool` (any object with `buffers()`). `kv_heads`: the
        global ids of the pool's KV heads (`Shard.kv_heads`); default all of them, from 0."""
        kv_heads = range(pool.num_kv_heads) if kv_heads is None else kv_heads
        if len(kv_heads) != pool.num_kv_heads or kv_heads.step != 1:
            raise ValueError(f"KV heads {kv_heads} are not the pool's {pool.num_kv_heads} heads")
        bufs = pool.buffers()
        return cls(
            buffers=tuple(b.reshape(-1).view(torch.uint8) for b in bufs),
            buffer_ptrs=[b.data_ptr() for b in bufs],
            buffer_nbytes=[b.numel() * b.element_size() for b in bufs],
            page_nbytes=pool.page_nbytes,
            page_size=pool.page_size,
            kv_dtype=kv_dtype,
            num_pages=pool.num_pages,
            start_layer=start_layer,
            kv_head_start=kv_heads.start,
            num_kv_heads=pool.num_kv_heads,
            kind=getattr(pool, "kind", KVKind.MHA),
            **aux,
        )


@dataclass(frozen=True)
class RankInfo:
    """This process's place in its instance. `bootstrap_url` is where a prefill rank
    registers (empty: the instance's server on 127.0.0.1:cfg.bootstrap_port)."""

    tp_rank: int = 0  # within its attention group (DP attention)
    pp_rank: int = 0
    bootstrap_url: str = ""
    dp_rank: int = 0


@dataclass(frozen=True)
class TransferFailure:
    """Why a room failed. `pages_unsafe`: the destination pages may still be written by
    the prefill side (a submitted write is never cancelled), so decode must quarantine them
    instead of freeing them while this is True."""

    reason: str
    pages_unsafe: bool = False


def adapter_tag(adapter: str) -> int:
    """What the aux record says of the LoRA adapter a prompt's KV was computed under: 0 for the base model, else
    64 bits of a hash of its name (the same on every instance), so that decode refuses KV of another adapter."""
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "little") if adapter else 0


def pack_first_token(
    token_id: int, logprob: float | None = None, top: Sequence[tuple[int, float]] | None = None, adapter: str = ""
) -> bytes:
    """The aux record of a request: its first output token, the adapter its prompt ran under (`adapter_tag`) and
    optionally its logprob and the top alternatives (token id, logprob) prefill saw for it."""
    head = _FIRST_TOKEN.pack(token_id, math.nan if logprob is None else logprob, adapter_tag(adapter))
    if top is None:
        return head
    return head + _TOP_COUNT.pack(len(top)) + b"".join(_TOP_ENTRY.pack(t, lp) for t, lp in top)


def pack_aux(
    token_id: int,
    logprob: float | None = None,
    top: Sequence[tuple[int, float]] | None = None,
    draft: bytes = b"",
    adapter: str = "",
) -> bytes:
    """The whole aux record: the first token's part, then (speculation with a draft model) what the draft
    hands decode, at offset AUX_ITEM_NBYTES (`engine.drafting.pack_draft_head`)."""
    head = pack_first_token(token_id, logprob, top, adapter)
    return head.ljust(AUX_ITEM_NBYTES, b"\0") + draft if draft else head


def unpack_draft(aux: bytes) -> bytes:
    """The draft's part of an aux record (b"" when it has none)."""
    return aux[AUX_ITEM_NBYTES:]


def unpack_first_token(aux: bytes) -> tuple[int, float | None]:
    token_id, logprob, _ = _FIRST_TOKEN.unpack_from(aux)
    return token_id, None if math.isnan(logprob) else logprob


def unpack_adapter_tag(aux: bytes) -> int:
    """The `adapter_tag` of the adapter the prompt's KV was computed under (0: the base model)."""
    return int(_FIRST_TOKEN.unpack_from(aux)[2])


def unpack_top_logprobs(aux: bytes) -> list[tuple[int, float]] | None:
    """The first token's top alternatives: None when the request asked for no logprobs."""
    if unpack_first_token(aux)[1] is None:
        return None
    if len(aux) < _FIRST_TOKEN.size + _TOP_COUNT.size:
        return []
    (n,) = _TOP_COUNT.unpack_from(aux, _FIRST_TOKEN.size)
    start = _FIRST_TOKEN.size + _TOP_COUNT.size
    return [_TOP_ENTRY.unpack_from(aux, start + i * _TOP_ENTRY.size) for i in range(min(n, MAX_LOGPROBS))]


class KVSender(ABC):
    """Prefill-side handle of one room."""

    room: int

    @abstractmethod
    def poll(self) -> KVPoll:
        """Current status; never blocks. Bootstrapping until decode sent its destination."""

    @abstractmethod
    def send(self, page_indices: list[int], last: bool, aux: bytes | None = None) -> None:
        """Queue pages (in prompt order, continuing where the previous call stopped) for
        transfer; `last=True` with the final chunk, carrying `aux`. Never blocks; errors
        (more pages than decode allocated, a call before WaitingForInput) fail the room."""

    def stream(self, page_indices: list[int]) -> None:
        """Layer-wise streaming: the next forward completes these pages (in prompt order, continuing where the
        previous stream, or the sends if further, stopped); each layer group of theirs is queued as soon as the
        forward computed it (`disagg.layerwise`), and a later send() of them moves only the layers no stream
        sent. Never blocks. A backend that does not stream ignores it: send() then moves every layer."""
        return None

    @abstractmethod
    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room here and tell decode."""

    @abstractmethod
    def failure_reason(self) -> str:
        """Why the room failed ("" unless poll() is Failed)."""

    def peers(self) -> list[str]:
        """The decode peers the room's pages go to, as a trace names them (none where the backend does not say)."""
        return []


class KVReceiver(ABC):
    """Decode-side handle of one room.

    Contract on failure: if poll() is Failed and `failure().pages_unsafe` is True, the
    destination pages given to init() may still be written by a transfer that prefill
    submitted and Mooncake does not cancel. Keep them out of the free list until
    `failure().pages_unsafe` turns False (prefill confirmed it stopped writing, or the
    prefill instance was confirmed dead via `KVManager.confirm_instance_dead`).
    """

    room: int

    @abstractmethod
    def poll(self) -> KVPoll:
        """Bootstrapping until the prefill instance is resolved and compatible, then
        WaitingForInput, Transferring once data flows, Success when every write landed."""

    @abstractmethod
    def init(self, dest_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        """Give the destination (one page per prompt page after the first `skip_pages`, in order: those decode
        already holds, and prefill does not send) and the aux slot. Call once; may be called before the
        handshake finishes (it is sent after it)."""

    @abstractmethod
    def abort(self, reason: str = "aborted by decode") -> None:
        """Fail the room here and tell prefill."""

    @abstractmethod
    def failure(self) -> TransferFailure | None:
        """None unless Failed; `pages_unsafe` may change from True to False later."""

    def failure_reason(self) -> str:
        f = self.failure()
        return f.reason if f else ""

    @abstractmethod
    def aux_bytes(self) -> bytes:
        """The aux record written by prefill (valid after Success)."""


def _nothing() -> None:
    pass


class KVManager(ABC):
    """One per scheduler process; owns the transfer engine and background threads."""

    def __init__(self, cfg: DisaggConfig, layout: KVLayout, rank: RankInfo, metrics: TransferMetrics):
        if cfg.role is Role.MONOLITHIC:
            raise ValueError("a KV manager needs role prefill or decode")
        self.cfg = cfg
        self.role = cfg.role
        self.layout = layout
        self.rank = rank
        self.metrics = metrics
        self.on_change: Callable[[], None] = _nothing  # set by the scheduler loop: wakes it up
        # Why this manager can no longer move KV ("" while it can): a background thread ended. The instance then
        # reports itself unhealthy (/health 503) instead of failing every room silently.
        self.broken = ""
        # Layer-wise streaming of this rank (prefill with --enable-disagg-layer-pipeline): the model's forward
        # reports each layer to it; None when sends move whole chunks.
        self.layer_stream: LayerStream | None = None

    def supervise(self, loop: Callable[[], None], name: str) -> threading.Thread:
        """Start a daemon thread running `loop`; if it ends by an exception, `broken` says so. The loop itself
        keeps one message's failure from ending it; this catches what escapes."""

        def run() -> None:
            try:
                loop()
            except BaseException as e:
                log.critical("the %s thread stopped", name, exc_info=True)
                self.broken = f"the KV transfer's {name} thread stopped ({type(e).__name__}); restart the instance"
                self.on_change()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def new_cell(self, initial: KVPoll = KVPoll.Bootstrapping) -> StatusCell:
        """A status cell whose every move calls `on_change` (from whichever thread moved it)."""
        return StatusCell(initial, on_change=lambda: self.on_change())

    def create_sender(self, room: int) -> KVSender:
        raise TypeError(f"a {self.role.value} manager has no senders")

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        raise TypeError(f"a {self.role.value} manager has no receivers")

    def confirm_instance_dead(self, bootstrap_addr: str) -> None:
        """Decode: the caller knows that prefill instance is gone; its pages are safe."""
        return None  # a backend that never quarantines pages has nothing to release

    @abstractmethod
    def close(self) -> None:
        """Stop threads and release the engine; live rooms fail."""


def check_pages(pages: list[int], num_pages: int) -> str:
    """ "" if every page index is valid, else a reason."""
    if not pages or (0 <= min(pages) and max(pages) < num_pages):
        return ""
    bad = [p for p in pages if not 0 <= p < num_pages]
    return f"page indices out of range [0, {num_pages}): {bad[:5]}" if bad else ""


__all__ = [
    "KVLayout",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "RankInfo",
    "TransferFailure",
    "pack_aux",
    "pack_first_token",
    "unpack_draft",
    "unpack_first_token",
    "unpack_top_logprobs",
    "check_pages",
]
