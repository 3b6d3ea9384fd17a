"""KV transfer between instances of several ranks (TP and PP mappings): bytes, writes and time.

One process per rank, as the engine runs them: each rank owns a KV pool of its shard's KV heads and
layers and its own `mooncake` KV manager (`RankInfo`), prefill ranks register with one bootstrap
server. Per mapping (prefill TP x PP -> decode TP x PP), rooms shaped like a fresh request of a
real model, scaled down to fit the machine: 32 layers, 8 KV heads of head_dim 32 in bf16 (a
quarter of Llama-3-8B's head_dim), 16-token pages, 1024 tokens: 32 MiB of KV per request. For each:
  - KV bytes the prefill ranks wrote per request against the ideal (layers x KV heads x tokens x
    head_dim x 2 (K, V) x bytes): a replicated head written twice, or whole pages where a slice was
    wanted, would show here;
  - Mooncake writes per request (counted at the engine's submit);
  - time from the first prefill rank's send() to the last decode rank's Success, relative to the
    1 -> 1 mapping timed in the same rounds (rooms alternate between the two pairs).
On a 2-core machine the ranks compete for the cores, so only these ratios mean anything, not a
speed-up. Writes bench/results/mapping.json and mapping.png.  Usage: python bench/bench_mapping.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
from disagg_worker.config import DisaggConfig, Role  # noqa: E402
from disagg_worker.disagg.mooncake.environ import mooncake_environ  # noqa: E402
from disagg_worker.env import load_env  # noqa: E402

# The transfer engine's environment as a scheduler process sets it; the rank processes inherit it.
_USER_LANES = load_env().mc_tcp_lanes_per_peer
os.environ.update(mooncake_environ(DisaggConfig(role=Role.PREFILL, mc_tcp_lanes_per_peer=_USER_LANES)))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKENS = 32, 8, 32, 16, 1024
NUM_PAGES = 2 * TOKENS // PAGE_SIZE  # a room's pages, and as many again to write them into
ELEMENT = 2  # bf16
# name: (prefill tp, pp), (decode tp, pp), KV heads, head_dim
MAPPINGS: dict[str, tuple[tuple[int, int], tuple[int, int], int, int]] = {
    "1->1": ((1, 1), (1, 1), KV_HEADS, HEAD_DIM),
    "TP 2->1": ((2, 1), (1, 1), KV_HEADS, HEAD_DIM),
    "TP 1->2": ((1, 1), (2, 1), KV_HEADS, HEAD_DIM),
    "TP 2->2": ((2, 1), (2, 1), KV_HEADS, HEAD_DIM),
    "PP 2->1": ((1, 2), (1, 1), KV_HEADS, HEAD_DIM),
    "PP 2->2": ((1, 2), (1, 2), KV_HEADS, HEAD_DIM),
    "TP 2->1, 1 KV head (replicated)": ((2, 1), (1, 1), 1, HEAD_DIM),
}
# Llama-3-8B's head_dim: a TP 2->1 room (128 MiB) no longer fits decode's 64 MiB staging area, so
# its head slices travel one token at a time. Measured separately (--unstaged), fewer rounds.
UNSTAGED = {"TP 2->1, head_dim 128 (room > decode staging)": ((2, 1), (1, 1), KV_HEADS, 128)}


def ideal_bytes(kv_heads: int, head_dim: int) -> int:
    return LAYERS * kv_heads * TOKENS * head_dim * 2 * ELEMENT


# ---- one rank per process ------------------------------------------------------------------------
def _rank(conn, role: str, shard_kw: dict, kv_heads: int, head_dim: int, url: str) -> None:
    """A rank, driven by (command, *args) over `conn`."""
    torch.set_num_threads(1)
    from disagg_worker.disagg import KVLayout, KVPoll, RankInfo, create_kv_manager
    from disagg_worker.mem.kv_pool import KVPool
    from disagg_worker.model.config import ModelConfig
    from disagg_worker.model.parallel import Shard

    shard = Shard(**shard_kw)
    model = ModelConfig("llama", 16, 64, 64, LAYERS, max(8, kv_heads), kv_heads, head_dim)
    heads, layers = shard.kv_heads(model), shard.layer_range(LAYERS)
    pool = KVPool(len(layers), NUM_PAGES, PAGE_SIZE, len(heads), head_dim, torch.bfloat16)
    for buf in pool.buffers():
        buf.normal_()
    layout = KVLayout.from_pool(pool, "bfloat16", start_layer=layers.start, kv_heads=heads)
    cfg = DisaggConfig(role=Role(role), tp_size=shard.tp_size, pp_size=shard.pp_size, waiting_timeout_s=120)
    mgr = create_kv_manager(cfg, layout, RankInfo(tp_rank=shard.tp_rank, pp_rank=shard.pp_rank, bootstrap_url=url))
    moved = threading.Event()  # as a server's loop waits: woken by every status move, no polling
    mgr.on_change = moved.set
    writes = [0]
    if role == "prefill":
        submit = mgr.engine.submit  # type: ignore[attr-defined]  # a Mooncake manager's engine

        def counted(peer: str, src: int, dst: int, nbytes: int) -> int:
            writes[0] += 1
            return submit(peer, src, dst, nbytes)

        mgr.engine.submit = counted  # type: ignore[attr-defined]
        assert mgr.registered.wait(60)  # type: ignore[attr-defined]
    handles: dict = {}
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        op, room, *args = cmd
        if op == "sender":
            handles[room] = mgr.create_sender(room)
            conn.send(True)
        elif op == "recv":
            handles[room] = mgr.create_receiver(room, args[0])
            handles[room].init(args[1], 0)
            conn.send(True)
        elif op == "send":  # wait for decode's request, then send the whole prompt at once
            while handles[room].poll() is KVPoll.Bootstrapping:
                time.sleep(0.0002)
            conn.send(True)
            conn.recv()  # go
            t0 = time.monotonic()
            handles[room].send(args[0], last=True)
            conn.send(t0)
        elif op == "wait":  # (status, when it was seen terminal, reason, bytes written, writes submitted)
            h = handles.pop(room)
            while not h.poll().terminal:
                moved.clear()
                if not h.poll().terminal:
                    moved.wait(1.0)
            conn.send((int(h.poll()), time.monotonic(), h.failure_reason(), mgr.metrics.bytes_total, writes[0]))
    mgr.close()


class Instance:
    def __init__(self, role: str, tp: int, pp: int, kv_heads: int, head_dim: int, url: str = ""):
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for p in range(pp):
            for t in range(tp):
                parent, child = ctx.Pipe()
                shard = {"tp_rank": t, "tp_size": tp, "pp_rank": p, "pp_size": pp}
                proc = ctx.Process(target=_rank, args=(child, role, shard, kv_heads, head_dim, url), daemon=True)
                proc.start()
                self.conns.append(parent)
                self.procs.append(proc)

    def ready(self) -> None:
        for c in self.conns:
            assert c.poll(300) and c.recv() == "ready"

    def all(self, *cmd) -> list:
        for c in self.conns:
            c.send(cmd)
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(10)


class Pair:
    """A prefill and a decode instance of one mapping."""

    def __init__(self, prefill: tuple[int, int], decode: tuple[int, int], kv_heads: int, head_dim: int):
        from disagg_worker.disagg.bootstrap import BootstrapServer

        self.server = BootstrapServer(0, tp_size=prefill[0], pp_size=prefill[1], host="127.0.0.1").start()
        self.addr = f"127.0.0.1:{self.server.port}"
        self.prefill = Instance("prefill", *prefill, kv_heads, head_dim, self.server.url)
        self.decode = Instance("decode", *decode, kv_heads, head_dim)
        self.prefill.ready()
        self.decode.ready()
        self.room = random.getrandbits(40) << 16
        self.bytes = self.writes = 0

    def run(self) -> dict:
        """One room: seconds from the first send() to the last Success, bytes and writes of it."""
        self.room += 1
        src, dst = list(range(TOKENS // PAGE_SIZE)), list(range(TOKENS // PAGE_SIZE, NUM_PAGES))
        self.prefill.all("sender", self.room)
        self.decode.all("recv", self.room, self.addr, dst)
        self.prefill.all("send", self.room, src)
        starts = self.prefill.all("go")
        ends = self.prefill.all("wait", self.room) + self.decode.all("wait", self.room)
        assert all(e[0] == 4 for e in ends), [e[2] for e in ends]  # KVPoll.Success
        done = ends[: len(self.prefill.conns)]
        nbytes, writes = sum(e[3] for e in done), sum(e[4] for e in done)
        out = {"seconds": max(e[1] for e in ends) - min(starts), "bytes": nbytes - self.bytes}
        out["writes"] = writes - self.writes
        self.bytes, self.writes = nbytes, writes
        return out

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.stop()


def measure(mappings: dict, rounds: int) -> dict:
    """Each mapping against 1 -> 1, rooms alternating between the two pairs."""
    base = Pair(*MAPPINGS["1->1"])
    out: dict = {}
    try:
        for name, (prefill, decode, kv, head_dim) in mappings.items():
            pair = Pair(prefill, decode, kv, head_dim) if name != "1->1" else base
            try:
                for _ in range(2):  # warm connections and staging
                    pair.run(), base.run()
                runs, base_runs = [], []
                for _ in range(rounds):
                    runs.append(pair.run())
                    base_runs.append(base.run())
            finally:
                if pair is not base:
                    pair.close()
            out[name] = summarise(runs, base_runs, kv, head_dim, prefill, decode)
            r = out[name]
            print(
                f"{name:>34}: bytes/ideal {r['bytes_over_ideal']:.3f}  writes {r['writes']}  "
                f"time/1->1 {r['time_over_1to1']:.2f} ({r['ms']:.1f} vs {r['ms_1to1']:.1f} ms)",
                flush=True,
            )
    finally:
        base.close()
    return out


def summarise(runs: list[dict], base_runs: list[dict], kv: int, head_dim: int, prefill, decode) -> dict:
    ms = statistics.median(r["seconds"] for r in runs) * 1e3
    ms_base = statistics.median(r["seconds"] for r in base_runs) * 1e3
    ratios = [r["seconds"] / b["seconds"] for r, b in zip(runs, base_runs, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    assert len({r["bytes"] for r in runs}) == 1 and len({r["writes"] for r in runs}) == 1, "bytes or writes varied"
    return {
        "prefill": {"tp": prefill[0], "pp": prefill[1]},
        "decode": {"tp": decode[0], "pp": decode[1]},
        "kv_heads": kv,
        "head_dim": head_dim,
        "bytes": runs[0]["bytes"],
        "ideal_bytes": ideal_bytes(kv, head_dim),
        "bytes_over_ideal": round(runs[0]["bytes"] / ideal_bytes(kv, head_dim), 4),
        "writes": runs[0]["writes"],
        "gbps": round(runs[0]["bytes"] / ms / 1e6, 3),
        "ms": round(ms, 2),
        "ms_1to1": round(ms_base, 2),
        "time_over_1to1": round(statistics.median(ratios), 3),
        "time_over_1to1_iqr": [round(q1, 3), round(q3, 3)],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["mappings"])
    rows = [result["mappings"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    series = [
        ("KV bytes written / ideal", [r["bytes_over_ideal"] for r in rows], None),
        ("Mooncake writes per request", [r["writes"] for r in rows], None),
        ("time / 1->1 in the same rounds (median, IQR)", [r["time_over_1to1"] for r in rows], rows),
    ]
    for ax, (title, values, err_rows) in zip(axes, series, strict=True):
        xs = range(len(names))
        if err_rows is None:
            ax.bar(xs, values)
        else:
            lo = [v - r["time_over_1to1_iqr"][0] for v, r in zip(values, err_rows, strict=True)]
            hi = [r["time_over_1to1_iqr"][1] - v for v, r in zip(values, err_rows, strict=True)]
            ax.bar(xs, values, yerr=[lo, hi], capsize=3)
        ax.axhline(1.0 if "writes" not in title else rows[0]["writes"], color="grey", lw=0.8, ls="--")
        ax.set_xticks(list(xs), [n.replace(" (replicated)", "\n(replicated)") for n in names], rotation=30, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    m = result["machine"]
    fig.suptitle(
        f"KV transfer per mapping, {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} bf16, {TOKENS} tokens "
        f"({m['cpu']}, {m['cores']} cores)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10, help="rooms per mapping (and as many 1->1 rooms)")
    ap.add_argument("--unstaged", action="store_true", help="only the room too large for staging; writes nothing")
    args = ap.parse_args()
    if args.unstaged:
        print(json.dumps(measure(UNSTAGED, 2), indent=2))
        return
    torch.set_num_threads(1)
    t0 = time.time()
    result: dict = {"machine": machine_info(mooncake="mooncake-transfer-engine-non-cuda, TCP loopback")}
    result["shape"] = {
        "layers": LAYERS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",
        "page_size": PAGE_SIZE,
        "tokens": TOKENS,
        "rounds": args.rounds,
    }
    result["mappings"] = measure(MAPPINGS, args.rounds)
    result["seconds"] = round(time.time() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mapping.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "mapping.png")


if __name__ == "__main__":
    main()
