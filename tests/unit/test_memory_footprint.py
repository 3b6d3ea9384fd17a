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

        before = rss()
        pool = KVPool(32, 2048, 16, 8, 64, torch.bfloat16)  # 32 layers x K, V x 32 MiB: 2 GiB
        allocated = rss()
        pool.k_buffer(0)[:1024] = 1.0  # half of one layer's K: 16 MiB written
        written = rss()
        k, v = pool.k_buffer(0), pool.v_buffer(0)
        assert bool((k[:1024] == 1).all()) and not bool(k[1024:].any()) and not bool(v.any())  # the rest reads as zeros
        print(before, allocated, written)
        """
    )
    before, allocated, written = (int(x) for x in out.split())
    assert allocated - before < 8 * MB, (before, allocated)
    assert 16 * MB <= written - allocated < 24 * MB, (allocated, written)
