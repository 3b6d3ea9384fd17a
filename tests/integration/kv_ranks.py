"""Prefill and decode instances of several ranks, one process per rank, as the engine's ranks run.

Each rank owns a KV pool of its shard's KV heads and layers (`Shard.kv_heads`, `Shard.layer_range`)
and its own KV manager created with its `RankInfo`; the prefill ranks register with one
`BootstrapServer` in the test process. A prefill rank's pool holds its slice of a reference model
KV (`reference`), so a test can tell what every decode rank must hold after a transfer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from disagg_worker.config import DisaggConfig, Role  # noqa: E402
from disagg_worker.disagg import KVLayout, KVPoll, RankInfo, create_kv_manager  # noqa: E402
from disagg_worker.disagg.bootstrap import BootstrapServer  # noqa: E402
from disagg_worker.disagg.mooncake.prefill import MooncakePrefillManager  # noqa: E402
from disagg_worker.mem.kv_pool import KVKind, KVPool  # noqa: E402
from disagg_worker.model.config import MLAConfig, ModelConfig  # noqa: E402
from disagg_worker.model.parallel import Shard  # noqa: E402
from tests.timing import scaled  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Geometry:
    """The model's KV shape and a pool's size, the same on every rank unless a test says otherwise."""

    kv_heads: int = 2
    layers: int = 4
    head_dim: int = 32
    page_size: int = 4
    num_pages: int = 64
    kv_dtype: str = "float32"
    # "mla": one latent of `head_dim` values per token and layer, which every TP rank holds (`kv_heads` 1).
    kind: str = "mha"

    def model(self) -> ModelConfig:
        mla = MLAConfig(kv_lora_rank=self.head_dim - 8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        return ModelConfig(
            arch="llama",
            vocab_size=16,
            hidden_size=64,
            intermediate_size=64,
            num_layers=self.layers,
            num_heads=8,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            mla=mla if self.kind == "mla" else None,
        )

    @property
    def pool_kind(self) -> KVKind:
        return KVKind(self.kind)


def reference(geo: Geometry) -> list[torch.Tensor]:
    """K of every layer, then V of every layer, all heads: `[num_pages, page_size, kv_heads, head_dim]`
    (MLA: the latent of every layer, `[num_pages, page_size, 1, head_dim]`)."""
    g = torch.Generator().manual_seed(1234)
    shape = (geo.num_pages, geo.page_size, geo.model().kv_num_heads, geo.head_dim)
    n = geo.pool_kind.buffers_per_layer * geo.layers
    return [torch.randn(shape, generator=g).to(DTYPES[geo.kv_dtype]) for _ in range(n)]


def per_layer(geo: Geometry, bufs: list[torch.Tensor], layers: range) -> list[torch.Tensor]:
    """The buffers of `layers` out of all layers' `bufs`, in pool order."""
    return [
        b
        for i in range(geo.pool_kind.buffers_per_layer)
        for b in bufs[i * geo.layers + layers.start : i * geo.layers + layers.stop]
    ]


def rank_pool(geo: Geometry, shard: Shard, fill: bool) -> tuple[KVPool, KVLayout]:
    """A rank's pool of its heads and layers (filled with its slice of `reference` when `fill`)."""
    m = geo.model()
    heads, layers = shard.kv_heads(m), shard.layer_range(geo.layers)
    pool = KVPool(
        len(layers), geo.num_pages, geo.page_size, len(heads), geo.head_dim, DTYPES[geo.kv_dtype], kind=geo.pool_kind
    )
    if fill:
        for buf, full in zip(pool.buffers(), per_layer(geo, reference(geo), layers), strict=True):
            buf.copy_(full[:, :, heads.start : heads.stop])
    return pool, KVLayout.from_pool(pool, geo.kv_dtype, start_layer=layers.start, kv_heads=heads)


def _child(conn, role: str, shard: dict, geo: dict, cfg_kw: dict, bootstrap_url: str) -> None:
    """One rank, driven by (command, *args) tuples over `conn`."""
    torch.set_num_threads(1)
    s, g = Shard(**shard), Geometry(**geo)
    pool, layout = rank_pool(g, s, fill=role == "prefill")
    cfg = DisaggConfig(role=Role(role), tp_size=s.tp_size, pp_size=s.pp_size, **cfg_kw)
    rank = RankInfo(tp_rank=s.tp_rank, pp_rank=s.pp_rank, bootstrap_url=bootstrap_url)
    mgr = create_kv_manager(cfg, layout, rank)
    handles: dict = {}
    created: dict[int, float] = {}
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "registered":
            assert isinstance(mgr, MooncakePrefillManager)
            conn.send(mgr.registered.wait(args[0]))
        elif cmd == "sender":
            handles[args[0]] = mgr.create_sender(args[0])
            conn.send(True)
        elif cmd == "recv":  # room, bootstrap addr, destination pages, aux slot
            room, addr, dest, slot = args
            created[room] = time.monotonic()
            handles[room] = mgr.create_receiver(room, addr)
            handles[room].init(dest, slot)
            conn.send(True)
        elif cmd == "until":  # room, status, timeout: the status reached (or the one it stopped at)
            room, status, timeout = args
            h, deadline = handles[room], time.monotonic() + timeout
            while h.poll() < status and not h.poll().terminal and time.monotonic() < deadline:
                time.sleep(0.002)
            conn.send((int(h.poll()), h.failure_reason()))
        elif cmd == "send":  # room, [(pages, last, aux)]
            for pages, last, aux in args[1]:
                handles[args[0]].send(pages, last, aux)
            conn.send(True)
        elif cmd == "wait":  # until terminal: (status, reason, seconds since the receiver was created)
            room, timeout = args
            h, deadline = handles[room], time.monotonic() + timeout
            while not h.poll().terminal and time.monotonic() < deadline:
                time.sleep(0.002)
            conn.send((int(h.poll()), h.failure_reason(), time.monotonic() - created.get(room, time.monotonic())))
        elif cmd == "kv":  # the decode pool's buffers at these pages
            index = torch.tensor(args[0], dtype=torch.long)
            conn.send([buf.index_select(0, index).clone() for buf in pool.buffers()])
        elif cmd == "aux":
            conn.send(handles[args[0]].aux_bytes())
        elif cmd == "moved":  # KV bytes this rank's finished transfers moved, as the transfer layer counts them
            conn.send(mgr.metrics.bytes_total)
        elif cmd == "stop":
            mgr.close()
            conn.send(True)
            return


class RankProc:
    def __init__(self, role: str, shard: Shard, geo: Geometry, cfg_kw: dict, bootstrap_url: str = ""):
        self.role, self.shard, self.geo = role, shard, geo
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, role, asdict(shard), asdict(geo), cfg_kw, bootstrap_url)
        self.proc = ctx.Process(target=_child, args=args, daemon=True)
        self.proc.start()

    def started(self) -> RankProc:
        assert self.conn.poll(scaled(120)) and self.conn.recv() == "ready", f"{self.role} rank did not start"
        return self

    def __call__(self, *cmd, timeout: float = 60):
        """Run a command in the rank's process; `timeout` (scaled) bounds its answer."""
        self.conn.send(cmd)
        assert self.conn.poll(scaled(timeout)), f"{self.role} rank did not answer {cmd[0]}"
        return self.conn.recv()

    def until(self, room: int, status: KVPoll, timeout: float) -> tuple[int, str]:
        """Until the room's handle reached `status` or ended, at most `timeout` (scaled): (status, reason)."""
        return self("until", room, int(status), scaled(timeout), timeout=timeout + 30)

    def wait(self, room: int, timeout: float) -> tuple[int, str, float]:
        """Until the room's handle is terminal, at most `timeout` (scaled): (status, reason, seconds since the
        receiver was created)."""
        return self("wait", room, scaled(timeout), timeout=timeout + 30)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("stop", timeout=10)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.kill()
        self.proc.join(scaled(5))


def ranks(role: str, tp: int, pp: int, geo: Geometry, cfg_kw: dict, url: str = "") -> list[RankProc]:
    """Every rank of an instance, starting (`RankProc.started` waits for one)."""
    return [RankProc(role, Shard(t, tp, p, pp), geo, cfg_kw, url) for p in range(pp) for t in range(tp)]


class Pair:
    """A prefill instance of `prefill = (tp, pp)` ranks and a decode instance of `decode = (tp, pp)`
    ranks; `decode_geo` may differ from the prefill's (a mismatched pair)."""

    def __init__(self, prefill: tuple[int, int], decode: tuple[int, int], geo: Geometry, **decode_geo):
        self.geo, self.decode_geo = geo, replace(geo, **decode_geo)
        self.server = BootstrapServer(0, tp_size=prefill[0], pp_size=prefill[1], host="127.0.0.1").start()
        self.addr = f"127.0.0.1:{self.server.port}"
        self.prefill: list[RankProc] = []
        self.decode: list[RankProc] = []
        try:
            self.prefill = ranks("prefill", *prefill, geo, {}, self.server.url)
            self.decode = ranks("decode", *decode, self.decode_geo, {})
            for rank in self.prefill + self.decode:  # all start at once: most of the time is imports
                rank.started()
            assert all(p("registered", scaled(30)) for p in self.prefill), "a prefill rank did not register"
        except BaseException:
            self.close()
            raise

    def expected(self, rank: RankProc, src: list[int]) -> list[torch.Tensor]:
        """What a decode rank's buffers must hold at the destination of `src`: its heads and layers."""
        m, geo = self.geo.model(), self.geo
        heads, layers = rank.shard.kv_heads(m), rank.shard.layer_range(geo.layers)
        mine = per_layer(geo, reference(geo), layers)
        index = torch.tensor(src, dtype=torch.long)
        return [full.index_select(0, index)[:, :, heads.start : heads.stop] for full in mine]

    def close(self) -> None:
        for p in self.decode + self.prefill:
            p.close()
        self.server.stop()
