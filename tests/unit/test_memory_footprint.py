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

        def rss():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

        bool(torch.zeros(1 << 20, dtype=torch.bfloat16).any())  # the kernels' code is loaded before measuring
        before = rss()
        pool = KVPool(32, 2048, 16, 8, 64, torch.bfloat16)  # 32 layers x K, V x 32 MiB: 2 GiB
        assert not any(bool(b.any()) for b in pool.buffers())  # every page reads as zero...
        allocated = rss()  # ...without becoming resident
        pool.k_buffer(0)[:1024] = 1.0  # half of one layer's K: 16 MiB written
        written = rss()
        k, v = pool.k_buffer(0), pool.v_buffer(0)
        assert bool((k[:1024] == 1).all()) and not bool(k[1024:].any()) and not bool(v.any())
        print(before, allocated, written)
        """
    )
    before, allocated, written = (int(x) for x in out.split())
    assert allocated - before < 128 * MB, (before, allocated)  # of 2 GiB (reductions' buffers: ~80 MB measured)
    assert 16 * MB <= written - allocated < 24 * MB, (allocated, written)
