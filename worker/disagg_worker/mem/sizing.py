"""How many KV pages `--mem-fraction-static` gives a rank: pure arithmetic over byte counts, and the host's memory.

SGLang's meaning: a fraction `f` of the device's memory holds the model's weights plus the KV pool; the rest is
left for activations (and CUDA graphs). After the weights load, the pool gets `f * total - resident` bytes, where
`resident` is what the device already holds (`engine.pools.size_pool` measures it), and as many pages as fit in
that at the bytes a page costs over every buffer of the pool. With the fraction off (0) the pool is sized by
`--num-pages` or `--max-total-tokens`, as before; both deciding the same count is refused.

On a CPU the device is the machine: its memory is MemTotal, or the cgroup's limit where that is lower (a pod on a
large node must not size its pool by the node), shared equally by the ranks of a pod. That is safe to allow here
because a CPU pool is an anonymous map that becomes resident only as pages are written (`mem.kv_pool`): a pool
sized for 90% of the machine costs nothing until requests fill it, just as a large `--max-total-tokens` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from disagg_worker.errors import ConfigError

FLAG = "--mem-fraction-static"
# cgroup v2, then v1: the memory limit of the container this process runs in ("max" or a huge number: none).
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def check_fraction(fraction: float, num_pages: int = 0) -> None:
    """Refuse a fraction outside [0, 1) (0: off), and one given with `--num-pages`, which sets the same count."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"{FLAG} {fraction}: a fraction of the device's memory, above 0 and below 1 (0: off)")
    if fraction and num_pages:
        raise ConfigError(f"{FLAG} {fraction} and --num-pages {num_pages} both set the KV pool's pages: keep one")


def pages_for_fraction(
    total_bytes: int,
    resident_bytes: int,
    page_bytes: int,
    fraction: float,
    min_pages: int,
    fewest: Callable[[int], int] = int,
) -> int:
    """The pages a pool of `page_bytes` a page gets from `fraction` of `total_bytes` once `resident_bytes` (the
    weights) are held; refused (ConfigError naming the flag) when fewer than `min_pages`, one request's worth.
    `fewest` turns this rank's count into the fewest of the instance's ranks (they must agree), before the
    refusal, so that every rank refuses together instead of one leaving the others waiting on it."""
    if not 0 < fraction < 1:
        raise ConfigError(f"{FLAG} {fraction}: a fraction of the device's memory, above 0 and below 1")
    if page_bytes <= 0:
        raise ValueError(f"a KV page costs {page_bytes} bytes")
    mine = max(0, int(fraction * total_bytes) - resident_bytes) // page_bytes
    pages = fewest(mine)
    if pages < min_pages:
        which = "" if pages == mine else f" on another rank (here {mine})"
        raise ConfigError(
            f"{FLAG} {fraction}: {_gib(fraction * total_bytes)} of the device's {_gib(total_bytes)}, less the "
            f"{_gib(resident_bytes)} already held (the weights), leaves {pages} KV pages{which} of {page_bytes} "
            f"bytes, fewer than the {min_pages} one request of the longest context needs: raise {FLAG} or lower "
            "--max-context-len"
        )
    return pages


def machine_memory(meminfo: str, cgroup_limit: str = "") -> int:
    """Bytes of memory this process may use: /proc/meminfo's MemTotal, or the cgroup's limit where lower."""
    total = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    limit = cgroup_limit.strip()
    return min(total, int(limit)) if limit.isdigit() else total


def host_memory() -> int:
    """This machine's memory as `machine_memory` counts it, read from /proc and the cgroup files."""
    limit = next((p.read_text() for p in map(Path, CGROUP_LIMITS) if p.is_file()), "")
    return machine_memory(Path("/proc/meminfo").read_text(), limit)


def process_resident() -> int:
    """Bytes this process holds in memory (its resident set: the loaded weights, packed copies included)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
