"""KV transfer throughput: Mooncake TCP between two processes vs a plain loopback socket.

Methods, interleaved per repetition, one receiver process on 127.0.0.1:
  socket                plain TCP socket (the loopback ceiling; gather/scatter by memcpy for pages)
  mooncake_sync         batch_transfer_sync_write (busy-waits the calling thread)
  mooncake_submit_poll  transfer_submit_write per run + sleep-poll (what the KV layer does)
  kv_manager            the `mooncake` KV manager end to end: prefill send() -> decode receiver
                        Success (scattered pages go through the managers' staging areas)
for contiguous sizes 4 KiB .. 512 MiB and 1000 scattered 16 KiB pages.
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
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 512 << 20]
PAGE = 16 << 10
SMALL_PAGE = 2 << 10  # contiguous sizes: n bytes = n/2 in each of K and V, whole 2 KiB pages
N_SCATTER = 1000
POOL = 512 << 20
RESULTS = Path(__file__).parent / "results"


def reps_for(nbytes: int) -> int:
    return 60 if nbytes <= (1 << 20) else 20 if nbytes <= (64 << 20) else 8


def scatter_pages(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    n = POOL // PAGE
    return rng.sample(range(n), N_SCATTER), rng.sample(range(n), N_SCATTER)


# ---- receiver process: socket server, raw engine, decode KV managers -----------------------
def _receiver(conn, addrs: dict) -> None:
    import threading

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
        header = sock.recv(16, socket.MSG_WAITALL)
        if len(header) < 16:
            return
        nbytes, scatter_seed = struct.unpack("<qq", header)
        target = memoryview(staging.numpy()) if scatter_seed >= 0 else view
        got = 0
        while got < nbytes:
            got += sock.recv_into(target[got:nbytes])
        if scatter_seed >= 0:  # scatter the received pages into their destinations
            _, dst = scatter_pages(scatter_seed)
            pages[torch.tensor(dst)] = staging.view(torch.int64).view(-1, PAGE // 8)
        sock.sendall(b"k")


def _manager_sink(conn, addrs: dict) -> None:
    from disagg_worker.config import DisaggConfig, Role
    from disagg_worker.disagg import KVPoll, create_kv_manager

    layouts = {p: _pool_layout(p) for p in addrs}
    mgrs = {p: create_kv_manager(DisaggConfig(role=Role.DECODE, waiting_timeout_s=120), lay)
            for p, (_, lay) in layouts.items()}
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        room, page_nbytes, dest = cmd
        r = mgrs[page_nbytes].create_receiver(room, addrs[page_nbytes])
        r.init(dest, 0)
        while not r.poll().terminal:  # decode's Success: staged pages are scattered by then
            time.sleep(0.00005)
        conn.send(int(r.poll()) == KVPoll.Success)
    for m in mgrs.values():
        m.close()


def _time_socket(sock, src: torch.Tensor, nbytes: int, seed: int = -1) -> float:
    t0 = time.perf_counter()
    if seed >= 0:
        srcp, _ = scatter_pages(seed)
        payload = src.view(torch.int64).view(-1, PAGE // 8).index_select(0, torch.tensor(srcp)).numpy()
    else:
        payload = src[:nbytes].numpy()
    sock.sendall(struct.pack("<qq", nbytes, seed))
    sock.sendall(memoryview(payload).cast("B"))
    assert sock.recv(1) == b"k"
    return time.perf_counter() - t0


def _time_mc(te, peer: str, writes: list[tuple[int, int, int]], mode: str) -> tuple[float, float]:
    """(seconds, CPU seconds of the calling thread) for one group of writes."""
    t0, c0 = time.perf_counter(), time.thread_time()
    if mode == "sync":
        s, d, n = zip(*writes)
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


def _pool_layout(page_nbytes: int):
    from disagg_worker.disagg import KVLayout

    bufs = [torch.zeros(POOL // 2, dtype=torch.uint8) for _ in range(2)]  # one layer: K and V
    layout = KVLayout([b.data_ptr() for b in bufs], [b.numel() for b in bufs], page_nbytes, 1, "uint8",
                      (POOL // 2) // page_nbytes)
    return bufs, layout


class Bench:
    """Sender side. Every repetition runs each method once, interleaved, so that load from
    other processes on the machine hits all methods alike."""

    def __init__(self):
        from mooncake.engine import TransferEngine

        from disagg_worker.config import DisaggConfig, Role
        from disagg_worker.disagg import RankInfo, create_kv_manager
        from disagg_worker.disagg.bootstrap import BootstrapServer

        self.servers, self.mgrs, addrs = {}, {}, {}
        for p in (SMALL_PAGE, PAGE):
            self.servers[p] = BootstrapServer(0, host="127.0.0.1").start()
            bufs, lay = _pool_layout(p)
            cfg = DisaggConfig(role=Role.PREFILL, waiting_timeout_s=120)
            self.mgrs[p] = (bufs, create_kv_manager(cfg, lay, RankInfo(bootstrap_url=self.servers[p].url)))
            addrs[p] = f"127.0.0.1:{self.servers[p].port}"
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

    def manager_once(self, page_nbytes: int, src: list[int], dst: list[int]) -> float:
        from disagg_worker.disagg import KVPoll

        self.room += 1
        sender = self.mgrs[page_nbytes][1].create_sender(self.room)
        self.conn.send((self.room, page_nbytes, dst))
        while sender.poll() is KVPoll.Bootstrapping:
            time.sleep(0.0002)
        t0 = time.perf_counter()
        sender.send(src, last=True)
        assert self.conn.recv()  # until decode reports Success, as the socket waits for the ack
        took = time.perf_counter() - t0
        while not sender.poll().terminal:
            time.sleep(0.0001)
        assert sender.poll() is KVPoll.Success, sender.failure_reason()
        return took

    def workloads(self, sizes: list[int]):
        sptr, dptr = self.src.data_ptr(), self.dptr
        for n in sizes:  # the manager moves n bytes as n/2 over each of the K and V buffers
            pages = list(range(n // 2 // SMALL_PAGE))
            yield str(n), n, [(sptr, dptr, n)], -1, (SMALL_PAGE, pages, pages)
        srcp, dstp = scatter_pages(7)
        writes = [(sptr + s * PAGE, dptr + d * PAGE, PAGE) for s, d in zip(srcp, dstp)]
        half = POOL // 2 // PAGE  # manager: 500 scattered pages x (K, V) = 1000 x 16 KiB writes
        msrc = list(dict.fromkeys(s % half for s in srcp))[:500]
        mdst = list(dict.fromkeys(d % half for d in dstp))[:500]
        yield "scattered", N_SCATTER * PAGE, writes, 7, (PAGE, msrc, mdst)

    def run(self, sizes: list[int]) -> dict:
        methods = ("socket", "mooncake_sync", "mooncake_submit_poll", "kv_manager")
        out: dict = {m: {} for m in methods} | {"cpu_s": {}, "iqr": {m: {} for m in methods}}
        for name, nbytes, writes, seed, (pn, msrc, mdst) in self.workloads(sizes):
            _time_mc(self.te, self.peer, writes, "poll")  # warm connections
            self.manager_once(pn, msrc, mdst)
            t: dict = {m: [] for m in methods} | {"cpu_sync": [], "cpu_poll": []}
            for _ in range(reps_for(nbytes)):
                t["socket"].append(_time_socket(self.sock, self.src, nbytes, seed))
                wall, cpu = _time_mc(self.te, self.peer, writes, "sync")
                t["mooncake_sync"].append(wall)
                t["cpu_sync"].append(cpu / wall)
                wall, cpu = _time_mc(self.te, self.peer, writes, "poll")
                t["mooncake_submit_poll"].append(wall)
                t["cpu_poll"].append(cpu / wall)
                t["kv_manager"].append(self.manager_once(pn, msrc, mdst))
            for m in methods:
                out[m][name] = nbytes / statistics.median(t[m]) / 1e9
                q1, _, q3 = statistics.quantiles(t[m], n=4)
                out["iqr"][m][name] = [round(nbytes / q3 / 1e9, 3), round(nbytes / q1 / 1e9, 3)]
            out["cpu_s"][name] = {"sync_cores": statistics.median(t["cpu_sync"]),
                                  "submit_poll_cores": statistics.median(t["cpu_poll"])}
            print(f"{name:>10}: " + "  ".join(f"{m} {out[m][name]:.2f}" for m in methods) + " GB/s", flush=True)
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

    labels = [*map(str, result["sizes"]), "scattered"]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    r = result["gbps"]
    series = {"socket (ceiling)": r["socket"], "mooncake sync (batch)": r["mooncake_sync"],
              "mooncake submit + sleep-poll": r["mooncake_submit_poll"], "KV manager (mooncake)": r["kv_manager"]}
    for name, vals in series.items():
        ax.plot(xs, [vals.get(k, float("nan")) for k in labels], marker="o", label=name)
    ax.set_xticks(list(xs), [_human(k) for k in labels], rotation=30)
    ax.set_ylabel("GB/s")
    m = result["machine"]
    ax.set_title(f"KV transfer over loopback TCP ({m['cpu']}, {m['cores']} cores, {m['kernel']})", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _human(key: str) -> str:
    if key == "scattered":
        return "1000x16KiB\nscattered"
    n = int(key)
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 MiB only")
    args = ap.parse_args()
    sizes = [s for s in SIZES if not args.quick or s <= 64 << 20]
    torch.set_num_threads(1)  # small shared machines: intra-op threads only add contention
    t0 = time.time()
    bench = Bench()
    try:
        gbps = bench.run(sizes)
    finally:
        bench.close()
    keys = [*map(str, sizes), "scattered"]
    ratio = {k: gbps["kv_manager"][k] / gbps["socket"][k] for k in keys}
    ratio_raw = {k: gbps["mooncake_submit_poll"][k] / gbps["socket"][k] for k in keys}
    result = {"machine": machine_info(), "load_avg_at_start": os.getloadavg(), "sizes": sizes, "gbps": gbps,
              "ratio_kv_manager_over_socket": ratio, "ratio_submit_poll_over_socket": ratio_raw,
              "seconds": round(time.time() - t0, 1), "unit": "GB/s (1e9 bytes/s), median of interleaved repetitions; iqr: [p25, p75] throughput"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transfer.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "transfer.png")
    for k, v in ratio.items():
        print(f"ratio kv_manager/socket {_human(k).replace(chr(10), ' '):>22}: {v:.2f}")


if __name__ == "__main__":
    main()
