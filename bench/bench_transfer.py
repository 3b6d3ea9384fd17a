"""KV transfer throughput: Mooncake TCP between two processes vs a plain loopback socket.

Methods, interleaved per repetition, one receiver process on 127.0.0.1:
  socket                plain TCP socket (the loopback ceiling; gather/scatter by memcpy for pages)
  mooncake_sync         batch_transfer_sync_write (busy-waits the calling thread)
  mooncake_submit_poll  transfer_submit_write per run + sleep-poll (what the KV layer does)
  mooncake_split        the same, each write first split into pieces as the KV manager splits an
                        idle peer's writes (`split_writes`), which Mooncake moves over several TCP
                        lanes at once; single pass only: the engine's own latency with the
                        manager's tuning, before its control plane
  kv_manager            the `mooncake` KV manager end to end: prefill send() -> decode receiver
                        Success (scattered pages go through the managers' staging areas)
for contiguous sizes 4 KiB .. 512 MiB and 1000 scattered 16 KiB pages, two ways:
  single    one transfer at a time, timed until the receiver has it (latency-bound for small sizes)
  streamed  bandwidth: `stream_count(size)` transfers issued back to back (64 MiB in flight, at
            most 32 transfers; one room each through the KV manager), timed until the receiver has
            the last one, as ib_write_bw or iperf measure a link. A prefill instance serving many
            requests moves KV this way.
and a third pass, `model`: one room at a time through the KV manager, shaped like a fresh request
of a real model (32 layers, so 64 KV buffers and 64 writes, with 32 KiB pages: 16 tokens of 8 KV
heads x 128 x bf16) for prompts of 16 to 1024 tokens, against the socket moving the same bytes.
Writes bench/results/transfer.json and transfer.png.  Usage: python bench/bench_transfer.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
from disagg_worker.config import DisaggConfig, Role  # noqa: E402
from disagg_worker.disagg.mooncake.environ import mooncake_environ  # noqa: E402
from disagg_worker.env import load_env  # noqa: E402

# The transfer engine's environment as a scheduler process sets it (TCP lanes per peer), for the
# raw engines too; the receiver process inherits it.
_USER_LANES = load_env().mc_tcp_lanes_per_peer
os.environ.update(mooncake_environ(DisaggConfig(role=Role.PREFILL, mc_tcp_lanes_per_peer=_USER_LANES)))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 512 << 20]
PAGE = 16 << 10
SMALL_PAGE = 2 << 10  # contiguous sizes: n bytes = n/2 in each of K and V, whole 2 KiB pages
N_SCATTER = 1000
POOL = 512 << 20
STREAM_BYTES = 64 << 20
STREAM_MAX = 32
PASSES = ("single", "streamed")
MODEL_LAYERS, MODEL_PAGE, MODEL_BUF = 32, 32 << 10, 4 << 20  # 64 buffers of 128 pages
MODEL_PAGE_TOKENS = 16
MODEL_TOKENS = [16, 64, 256, 1024]  # 2, 8, 32 and 128 MiB rooms
RESULTS = Path(__file__).parent / "results"


def reps_for(nbytes: int) -> int:
    return 60 if nbytes <= (1 << 20) else 20 if nbytes <= (64 << 20) else 8


def stream_count(nbytes: int) -> int:
    """Transfers of `nbytes` issued back to back in the streamed pass."""
    return max(1, min(STREAM_MAX, STREAM_BYTES // nbytes))


def scatter_pages(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    n = POOL // PAGE
    return rng.sample(range(n), N_SCATTER), rng.sample(range(n), N_SCATTER)


# ---- receiver process: socket server, raw engine, decode KV managers -----------------------
def _receiver(conn, addrs: dict) -> None:
    torch.set_num_threads(1)
    from mooncake.engine import TransferEngine

    buf = torch.zeros(POOL, dtype=torch.uint8)
    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    te.register_memory(buf.data_ptr(), POOL)
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send((f"127.0.0.1:{te.get_rpc_port()}", buf.data_ptr(), srv.getsockname()[1]))
    threading.Thread(target=_socket_sink, args=(srv, buf), daemon=True).start()
    _manager_sink(conn, addrs)


def _socket_sink(srv, buf: torch.Tensor) -> None:
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(buf.numpy())
    staging = torch.empty(N_SCATTER * PAGE, dtype=torch.uint8)
    pages = buf.view(torch.int64).view(-1, PAGE // 8)  # 8-byte elements: much faster row copies
    while True:
        header = sock.recv(24, socket.MSG_WAITALL)
        if len(header) < 24:
            return
        nbytes, scatter_seed, count = struct.unpack("<qqq", header)
        target = memoryview(staging.numpy()) if scatter_seed >= 0 else view
        got, total = 0, nbytes * count  # message i lands at [i * nbytes, (i + 1) * nbytes)
        while got < total:
            got += sock.recv_into(target[got:total])
        if scatter_seed >= 0:  # scatter the received pages into their destinations
            _, dst = scatter_pages(scatter_seed)
            pages[torch.tensor(dst)] = staging.view(torch.int64).view(-1, PAGE // 8)
        sock.sendall(b"k")


def _manager_sink(conn, addrs: dict) -> None:
    from disagg_worker.disagg import KVPoll, create_kv_manager

    mgrs, pools = {}, {}  # the pools must outlive the managers: they are registered memory
    moved = threading.Event()  # as a decode server's loop waits: woken by every status move
    for name in addrs:
        pools[name], lay = _layout_of(name)
        mgrs[name] = create_kv_manager(DisaggConfig(role=Role.DECODE, waiting_timeout_s=120), lay)
        mgrs[name].on_change = moved.set
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        rooms, name, dests = cmd
        receivers = [mgrs[name].create_receiver(room, addrs[name]) for room in rooms]
        for slot, (r, dest) in enumerate(zip(receivers, dests, strict=True)):
            r.init(dest, slot)
        pending = receivers[::-1]  # rooms finish about in order: watch the oldest, then the next
        while pending:
            moved.clear()
            if pending[-1].poll().terminal:  # decode's Success: staged pages are scattered by then
                pending.pop()
            else:
                moved.wait(1.0)
        conn.send(all(int(r.poll()) == KVPoll.Success for r in receivers))
    for m in mgrs.values():
        m.close()


def _time_socket(sock, src: torch.Tensor, nbytes: int, seed: int = -1, count: int = 1) -> float:
    """`count` messages of `nbytes` sent back to back, until the receiver acknowledges the last."""
    t0 = time.perf_counter()
    sock.sendall(struct.pack("<qqq", nbytes, seed, count))
    if seed >= 0:
        srcp, _ = scatter_pages(seed)
        payload = src.view(torch.int64).view(-1, PAGE // 8).index_select(0, torch.tensor(srcp)).numpy()
        sock.sendall(memoryview(payload).cast("B"))
    else:
        view = memoryview(src.numpy())
        for i in range(count):
            sock.sendall(view[i * nbytes : (i + 1) * nbytes])
    assert sock.recv(1) == b"k"
    return time.perf_counter() - t0


def _time_mc(te, peer: str, writes: list[tuple[int, int, int]], mode: str) -> tuple[float, float]:
    """(seconds, CPU seconds of the calling thread) for one group of writes."""
    t0, c0 = time.perf_counter(), time.thread_time()
    if mode == "sync":
        s, d, n = zip(*writes, strict=True)
        rc = te.batch_transfer_sync_write(peer, list(s), list(d), list(n))
        assert rc == 0, rc
    else:
        handles = [te.transfer_submit_write(peer, s, d, n) for s, d, n in writes]
        for h in handles:
            sleep = 0.00002
            while (rc := te.transfer_check_status(h)) == 0:
                time.sleep(sleep)
                sleep = min(2 * sleep, 0.0005)
            assert rc == 1, rc
    return time.perf_counter() - t0, time.thread_time() - c0


def _pool_layout(page_nbytes: int, layers: int = 1, buf_nbytes: int = POOL // 2):
    from disagg_worker.disagg import KVLayout

    bufs = [torch.zeros(buf_nbytes, dtype=torch.uint8) for _ in range(2 * layers)]  # K and V per layer
    layout = KVLayout(
        [b.data_ptr() for b in bufs], [b.numel() for b in bufs], page_nbytes, 1, "uint8", buf_nbytes // page_nbytes
    )
    return bufs, layout


def _layout_of(name: str):
    """The pool of a manager pair: `small` and `page` (one layer), `model` (32 layers)."""
    if name == "model":
        return _pool_layout(MODEL_PAGE, MODEL_LAYERS, MODEL_BUF)
    return _pool_layout(SMALL_PAGE if name == "small" else PAGE)


class Bench:
    """Sender side. Every repetition runs each method once, interleaved, so that load from
    other processes on the machine hits all methods alike."""

    def __init__(self):
        from mooncake.engine import TransferEngine

        from disagg_worker.disagg import RankInfo, create_kv_manager
        from disagg_worker.disagg.bootstrap import BootstrapServer

        self.servers, self.mgrs, addrs = {}, {}, {}
        for name in ("small", "page", "model"):
            self.servers[name] = BootstrapServer(0, host="127.0.0.1").start()
            bufs, lay = _layout_of(name)
            cfg = DisaggConfig(role=Role.PREFILL, waiting_timeout_s=120)
            self.mgrs[name] = (bufs, create_kv_manager(cfg, lay, RankInfo(bootstrap_url=self.servers[name].url)))
            addrs[name] = f"127.0.0.1:{self.servers[name].port}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(child, addrs), daemon=True)
        self.proc.start()
        self.peer, self.dptr, port = self.conn.recv()
        assert self.conn.recv() == "ready"
        self.src = torch.randint(0, 255, (POOL,), dtype=torch.uint8)
        self.te = TransferEngine()
        self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        self.te.register_memory(self.src.data_ptr(), POOL)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.room = random.getrandbits(48)

    def manager_run(self, name: str, transfers: list[tuple[list[int], list[int]]]) -> float:
        """One room per (src pages, dst pages) through decode manager `name`, handshaken before the
        clock starts; seconds from the first send() until decode reports Success for every room."""
        from disagg_worker.disagg import KVPoll

        rooms = list(range(self.room + 1, self.room + 1 + len(transfers)))
        self.room += len(transfers)
        senders = [self.mgrs[name][1].create_sender(room) for room in rooms]
        self.conn.send((rooms, name, [dst for _, dst in transfers]))
        for sender in senders:
            while sender.poll() is KVPoll.Bootstrapping:
                time.sleep(0.0002)
        t0 = time.perf_counter()
        for sender, (src, _) in zip(senders, transfers, strict=True):
            sender.send(src, last=True)
        assert self.conn.recv()  # until decode reports Success, as the socket waits for the ack
        took = time.perf_counter() - t0
        for sender in senders:
            while not sender.poll().terminal:
                time.sleep(0.0001)
            assert sender.poll() is KVPoll.Success, sender.failure_reason()
        return took

    def workloads(self, sizes: list[int], streamed: bool):
        """(name, bytes per transfer, count, raw writes, scatter seed, (manager pair, manager transfers))."""
        sptr, dptr = self.src.data_ptr(), self.dptr
        for n in sizes:  # the manager moves n bytes as n/2 over each of the K and V buffers
            count, m = stream_count(n) if streamed else 1, n // 2 // SMALL_PAGE
            writes = [(sptr + i * n, dptr + i * n, n) for i in range(count)]
            rooms = [(list(range(i * m, (i + 1) * m)),) * 2 for i in range(count)]
            yield str(n), n, count, writes, -1, ("small", rooms)
        if streamed:
            return
        srcp, dstp = scatter_pages(7)
        writes = [(sptr + s * PAGE, dptr + d * PAGE, PAGE) for s, d in zip(srcp, dstp, strict=True)]
        half = POOL // 2 // PAGE  # manager: 500 scattered pages x (K, V) = 1000 x 16 KiB writes
        msrc = list(dict.fromkeys(s % half for s in srcp))[:500]
        mdst = list(dict.fromkeys(d % half for d in dstp))[:500]
        yield "scattered", N_SCATTER * PAGE, 1, writes, 7, ("page", [(msrc, mdst)])

    def run(self, sizes: list[int], streamed: bool) -> dict:
        from disagg_worker.disagg.mooncake.prefill_writes import split_writes

        methods = ("socket", "mooncake_sync", "mooncake_submit_poll", "kv_manager")
        methods += () if streamed else ("mooncake_split",)
        out: dict = {m: {} for m in methods} | {"cpu_s": {}, "iqr": {m: {} for m in methods}, "count": {}}
        for name, nbytes, count, writes, seed, (pn, rooms) in self.workloads(sizes, streamed):
            _time_mc(self.te, self.peer, writes, "poll")  # warm connections
            self.manager_run(pn, rooms)
            t: dict = {m: [] for m in methods} | {"cpu_sync": [], "cpu_poll": []}
            split = split_writes(writes)
            for _ in range(reps_for(nbytes * count)):
                t["socket"].append(_time_socket(self.sock, self.src, nbytes, seed, count))
                wall, cpu = _time_mc(self.te, self.peer, writes, "sync")
                t["mooncake_sync"].append(wall)
                t["cpu_sync"].append(cpu / wall)
                wall, cpu = _time_mc(self.te, self.peer, writes, "poll")
                t["mooncake_submit_poll"].append(wall)
                t["cpu_poll"].append(cpu / wall)
                t["kv_manager"].append(self.manager_run(pn, rooms))
                if not streamed:
                    t["mooncake_split"].append(_time_mc(self.te, self.peer, split, "poll")[0])
            total = nbytes * count
            for m in methods:
                out[m][name] = total / statistics.median(t[m]) / 1e9
                q1, _, q3 = statistics.quantiles(t[m], n=4)
                out["iqr"][m][name] = [round(total / q3 / 1e9, 3), round(total / q1 / 1e9, 3)]
            out["cpu_s"][name] = {
                "sync_cores": statistics.median(t["cpu_sync"]),
                "submit_poll_cores": statistics.median(t["cpu_poll"]),
            }
            out["count"][name] = count
            label = f"{name} x{count}" if streamed else name
            print(f"{label:>14}: " + "  ".join(f"{m} {out[m][name]:.2f}" for m in methods) + " GB/s", flush=True)
        return out

    def run_model(self, tokens: list[int]) -> dict:
        """One model-shaped room at a time (a fresh request: one page run per buffer) and the
        socket moving the same bytes, interleaved."""
        methods = ("socket", "kv_manager")
        out: dict = {m: {} for m in methods} | {"bytes": {}}
        for t in tokens:
            pages, dst = -(-t // MODEL_PAGE_TOKENS), MODEL_BUF // MODEL_PAGE // 2  # dst: the second half
            room = [(list(range(pages)), list(range(dst, dst + pages)))]
            nbytes = pages * MODEL_PAGE * 2 * MODEL_LAYERS
            self.manager_run("model", room)  # warm
            times: dict = {m: [] for m in methods}
            for _ in range(reps_for(nbytes)):
                times["socket"].append(_time_socket(self.sock, self.src, nbytes))
                times["kv_manager"].append(self.manager_run("model", room))
            for m in methods:
                out[m][str(t)] = nbytes / statistics.median(times[m]) / 1e9
            out["bytes"][str(t)] = nbytes
            print(
                f"{t:>5} tokens ({nbytes >> 20} MiB): "
                + "  ".join(f"{m} {out[m][str(t)]:.2f}" for m in methods)
                + " GB/s",
                flush=True,
            )
        return out

    def close(self) -> None:
        self.conn.send(None)
        self.sock.close()
        self.proc.join(10)
        for _, mgr in self.mgrs.values():
            mgr.close()
        for srv in self.servers.values():
            srv.stop()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8), gridspec_kw={"width_ratios": [3, 3, 2]})
    axes[1].sharey(axes[0])
    _plot_model(axes[2], result["model"])
    for ax, mode in zip(axes, PASSES, strict=False):  # the third axis holds the model pass
        r = result[mode]["gbps"]
        labels = [k for k in [*map(str, result["sizes"]), "scattered"] if k in r["socket"]]
        xs = range(len(labels))
        series = {
            "socket (ceiling)": r["socket"],
            "mooncake sync (batch)": r["mooncake_sync"],
            "mooncake submit + sleep-poll": r["mooncake_submit_poll"],
            "KV manager (mooncake)": r["kv_manager"],
        }
        if "mooncake_split" in r:
            series["mooncake, writes split into pieces + sleep-poll"] = r["mooncake_split"]
        for name, vals in series.items():
            ax.plot(xs, [vals[k] for k in labels], marker="o", label=name)
        ticks = [_human(k) + (f"\nx{r['count'][k]}" if mode == "streamed" else "") for k in labels]
        ax.set_xticks(list(xs), ticks, rotation=30, fontsize=8)
        ax.set_title("one transfer at a time" if mode == "single" else "streamed: transfers back to back", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"KV transfer over loopback TCP ({m['cpu']}, {m['cores']} cores, {m['kernel']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_model(ax, model: dict) -> None:
    series = {"socket (ceiling)": "socket", "KV manager (mooncake)": "kv_manager"}
    tokens = [str(t) for t in model["tokens"]]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(tokens))], [model["gbps"][key][t] for t in tokens], width, label=label)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(tokens))],
        [f"{t} tokens\n{model['bytes'][t] >> 20} MiB" for t in tokens],
        fontsize=8,
    )
    ax.set_title("one room at a time, 32 layers (64 KV buffers, 32 KiB pages)", fontsize=9)
    ax.set_ylabel("GB/s")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def _human(key: str) -> str:
    if key == "scattered":
        return "1000x16KiB\nscattered"
    n = int(key)
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 MiB only")
    ap.add_argument("--model-only", action="store_true", help="only the model-shaped pass; writes nothing")
    args = ap.parse_args()
    sizes = [s for s in SIZES if not args.quick or s <= 64 << 20]
    torch.set_num_threads(1)  # small shared machines: intra-op threads only add contention
    t0 = time.time()
    load = os.getloadavg()
    bench = Bench()
    result: dict = {"machine": machine_info(), "load_avg_at_start": load, "sizes": sizes}
    try:
        for mode in PASSES if not args.model_only else ():
            print(f"-- {mode}", flush=True)
            gbps = bench.run(sizes, streamed=mode == "streamed")
            result[mode] = {
                "gbps": gbps,
                "ratio_kv_manager_over_socket": _ratios(gbps, "kv_manager"),
                "ratio_submit_poll_over_socket": _ratios(gbps, "mooncake_submit_poll"),
            }
            if "mooncake_split" in gbps:
                result[mode]["ratio_split_over_socket"] = _ratios(gbps, "mooncake_split")
        print("-- model (one room at a time, 64 KV buffers)", flush=True)
        m = bench.run_model(MODEL_TOKENS)
        result["model"] = {
            "tokens": MODEL_TOKENS,
            "bytes": m.pop("bytes"),
            "gbps": m,
            "ratio_kv_manager_over_socket": _ratios(m, "kv_manager"),
        }
    finally:
        bench.close()
    if args.model_only:
        print(json.dumps(result["model"]["ratio_kv_manager_over_socket"]))
        return
    result |= {
        "seconds": round(time.time() - t0, 1),
        "unit": "GB/s (1e9 bytes/s), median of interleaved repetitions; iqr: [p25, p75] throughput",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transfer.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "transfer.png")
    for mode in PASSES:
        for k, v in result[mode]["ratio_kv_manager_over_socket"].items():
            split = result[mode].get("ratio_split_over_socket", {}).get(k)
            print(
                f"{mode:>8} ratio kv_manager/socket {_human(k).replace(chr(10), ' '):>20}: {v:.2f}"
                + (f"  (mooncake, writes split: {split:.2f})" if split is not None else "")
            )


def _ratios(gbps: dict, method: str) -> dict:
    return {k: round(gbps[method][k] / gbps["socket"][k], 3) for k in gbps["socket"]}


if __name__ == "__main__":
    main()
