"""What a server's processes hold in memory: the HTTP front end and the router run without torch (~500 MB of
any process that imports it), and a CPU KV pool holds the pages written to it, not its capacity."""

from __future__ import annotations

import subprocess
import sys
import textwrap

MB = 1024 * 1024


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_spawning_the_ranks_of_a_multi_rank_instance_imports_no_torch_in_the_http_process():
    out = run_python(
        """
        import multiprocessing as mp, sys, types
        started = []
        proc = types.SimpleNamespace(start=lambda: None)
        ctx = types.SimpleNamespace(Process=lambda **kw: started.append(kw) or proc)
        mp.get_context = lambda kind: ctx
        from disagg_worker.config import DisaggConfig, EngineConfig
        from disagg_worker.instance.process import spawn_schedulers
        spawn_schedulers(EngineConfig("m", disagg=DisaggConfig(tp_size=2)), "ipc:///tmp/a", "ipc:///tmp/b", "info")
        print(len(started), "torch" in sys.modules)
        """
    )
    assert out.split() == ["2", "False"]


def test_the_http_front_end_the_bootstrap_server_and_the_router_import_no_torch():
    out = run_python(
        """
        import sys
        import disagg_worker.cli, disagg_worker.server.launch, disagg_worker.router.app, disagg_worker.disagg.bootstrap
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "xgrammar"))))
        """
    )
    assert out.strip() == "[]"


def test_a_cpu_kv_pool_holds_the_pages_written_not_its_capacity():
    out = run_python(
        """
        import torch
        from disagg_worker.mem.kv_pool import KVPool

        def resident(pool):
            # The Rss of the memory maps holding the pool's buffers, not of the process: what the reductions below
            # allocate lives in the allocator's maps, and the kernel's shared zero page is in no map's Rss.
            spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in pool.buffers()]
            total, inside = 0, False
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split()[0]
                    if "-" in head and not head.endswith(":"):
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        inside = any(lo < end and start < hi for start, end in spans)
                    elif inside and head == "Rss:":
                        total += int(line.split()[1]) * 1024
            return total

        pool = KVPool(32, 2048, 16, 8, 64, torch.bfloat16)  # 32 layers x K, V x 32 MiB: 2 GiB
        assert not any(bool(b.any()) for b in pool.buffers())  # every page reads as zero...
        allocated = resident(pool)  # ...without becoming resident
        pool.k_buffer(0)[:1024] = 1.0  # half of one layer's K: 16 MiB written
        written = resident(pool)
        k, v = pool.k_buffer(0), pool.v_buffer(0)
        assert bool((k[:1024] == 1).all()) and not bool(k[1024:].any()) and not bool(v.any())
        print(pool.nbytes, allocated, written)
        """
    )
    capacity, allocated, written = (int(x) for x in out.split())
    assert capacity == 2048 * MB
    assert allocated < 4 * MB, allocated  # of 2 GiB
    assert 16 * MB <= written < 24 * MB, written
