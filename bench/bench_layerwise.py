"""Layer-wise KV streaming: TTFT through P/D over monolithic, whole-request vs layer-wise sends.

One prompt at a time (fresh random token ids, so no prefix cache helps) of --sizes tokens through
`disagg router` -> `disagg prefill` -> `disagg decode` (Mooncake TCP), and through a monolithic `disagg serve`;
TTFT is the wall time of a one-token /generate. Two P/D stacks run side by side, the prefill of one streaming
layer-wise (the default, its minimum prompt lowered to the smallest size), the other with
`--disable-disagg-layer-pipeline`, so the ratios come from one run, interleaved round by round.

Links: `loopback` (everything on 127.0.0.1) and `limited`: prefill runs in its own network namespace joined to
the root namespace by a veth pair shaped by tc (tbf, --rate), so the KV crosses a slow link as it would cross a
NIC, while compute stays the CPU's. The model is the tiny random Llama made as deep as Llama-3.1-8B (32 layers, so
the default group of 4 layers makes 8 groups, as there) and thin enough for a CPU (8 KiB of KV per token: an 8k
prompt's KV is 64 MiB); the transfer/compute ratio modelled is reported (an 8B model on one H100 moves ~128 KiB/token
while it prefills at ~15-30k tokens/s: over a 100 Gbit/s NIC that is a transfer of ~10-20% of the prefill; the
default 500 Mbit/s link makes it 15% at 4k tokens here, 9% at 8k). Medians of --rounds rounds (5: this machine's
round-to-round spread is about 2%). Bytes moved are read from prefill's `disagg_kv_transfer_bytes_total` (counted at the
Mooncake layer) for both modes over the same prompts (the routers' pair verification, a one-token request through
the pair every 10 s, is off so that only the prompts move KV).

Needs root (ip netns, tc) for the limited link; nothing leaves the machine. Writes bench/results/layerwise.json
and layerwise.png.  Usage: python bench/bench_layerwise.py [--rounds N] [--rate 500mbit]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DISAGG, RESULTS, free_port, get_json, machine_info  # noqa: E402

NS, VETH_ROOT, VETH_NS = "lwbench", "lwb0", "lwb1"
ROOT_IP, NS_IP = "10.231.77.1", "10.231.77.2"
# Llama-3.1-8B's depth (32 layers: the default group of 4 makes 8 groups, as it does there), thin (GQA 4:1, head_dim 32)
# so that a CPU prefills 8k tokens in seconds; 32 layers x K+V x 1 head x 32 x fp32 = 8 KiB of KV per token.
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16384,
}
KV_BYTES_PER_TOKEN = 32 * 2 * 1 * 32 * 4


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def link_up(rate: str) -> None:
    link_down()
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", VETH_ROOT, "type", "veth", "peer", "name", VETH_NS)
    sh("ip", "link", "set", VETH_NS, "netns", NS)
    sh("ip", "addr", "add", f"{ROOT_IP}/30", "dev", VETH_ROOT)
    sh("ip", "link", "set", VETH_ROOT, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", VETH_NS)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", VETH_NS, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
    shape = ["root", "tbf", "rate", rate, "burst", "1mb", "latency", "100ms"]
    sh("tc", "qdisc", "add", "dev", VETH_ROOT, *shape)
    sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", VETH_NS, *shape)


def bits_per_second(rate: str) -> float | None:
    """tc's rate ("1gbit", "500mbit", "100kbit") in bits per second; None for other units."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)] or 1) * scale
    return None


def link_down() -> None:
    subprocess.run(["ip", "link", "del", VETH_ROOT], stderr=subprocess.DEVNULL)
    subprocess.run(["ip", "netns", "del", NS], stderr=subprocess.DEVNULL)


class Proc:
    def __init__(self, argv: list[str], url: str, netns: str = ""):
        self.url = url
        fd, self.log = tempfile.mkstemp(prefix="bench-layerwise-", suffix=".log")
        os.close(fd)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        env = {**os.environ, "MC_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*prefix, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited: {Path(self.log).read_text()[-3000:]}")
            try:
                if get_json(f"{self.url}/health").get("status") == "ok":
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} did not become healthy: {Path(self.log).read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def engine_flags(max_len: int) -> list[str]:
    return [
        "--page-size",
        "16",
        "--chunk-size",
        "2048",
        "--max-total-tokens",
        str(2 * max_len + 4096),
        "--max-batch-tokens",
        "2048",
        "--torch-threads",
        "1",
        "--log-level",
        "warning",
    ]


def pd_stack(model: str, secret: str, max_len: int, layerwise: bool, limited: bool, min_len: int) -> list[Proc]:
    """prefill (in the namespace on the limited link), decode and router; the router listed last."""
    host, ns = (NS_IP, NS) if limited else ("127.0.0.1", "")
    dhost = ROOT_IP if limited else "127.0.0.1"
    pp, bp, dp, rp = free_port(), free_port(), free_port(), free_port()
    common = [*engine_flags(max_len), "--auth-token-file", secret, "--served-model-name", "tiny"]
    lw = ["--disagg-layer-pipeline-min-prefill-len", str(min_len)] if layerwise else ["--disable-disagg-layer-pipeline"]
    prefill = Proc(
        [
            DISAGG,
            "prefill",
            "--model",
            model,
            "--port",
            str(pp),
            "--host",
            host,
            "--advertise-host",
            host,
            "--bootstrap-port",
            str(bp),
            *common,
            *lw,
        ],
        f"http://{host}:{pp}",
        ns,
    )
    decode = Proc(
        [DISAGG, "decode", "--model", model, "--port", str(dp), "--host", dhost, "--advertise-host", dhost, *common],
        f"http://{dhost}:{dp}",
    )
    for p in (prefill, decode):
        p.wait_healthy()
    router = Proc(
        [
            DISAGG,
            "router",
            "--port",
            str(rp),
            "--served-model-name",
            "tiny",
            "--prefill",
            prefill.url,
            str(bp),
            "--decode",
            decode.url,
            "--auth-token-file",
            secret,
            "--verify-interval",
            "0",
        ],
        f"http://127.0.0.1:{rp}",
    )
    router.wait_healthy()
    return [prefill, decode, router]


def ttft(url: str, ids: list[int]) -> float:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - t0


WORKER_TOKEN = {"value": ""}  # what the router presents to the workers (their /metrics needs it)


def kv_bytes(url: str) -> float:
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {WORKER_TOKEN['value']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("disagg_kv_transfer_bytes_total{"))


def settled_bytes(url: str) -> float:
    """The counter once the scheduler's series reached /metrics (they arrive a moment later)."""
    last = -1.0
    while (now := kv_bytes(url)) != last:
        last = now
        time.sleep(1.5)
    return now


def run_link(args, model: str, secret: str, mono: Proc, limited: bool) -> dict:
    max_len = max(args.sizes)
    stacks = {
        "whole": pd_stack(model, secret, max_len, False, limited, min(args.sizes)),
        "layer": pd_stack(model, secret, max_len, True, limited, min(args.sizes)),
    }
    try:
        out: dict = {}
        rng = random.Random(11)
        base = {m: settled_bytes(s[0].url) for m, s in stacks.items()}
        for n in args.sizes:
            times: dict[str, list[float]] = {"mono": [], "whole": [], "layer": []}
            warm = [rng.randrange(10, 2000) for _ in range(n)]
            for url in (mono.url, *(s[2].url for s in stacks.values())):
                ttft(url, warm)  # first use of a size: allocations, not what is measured
            for r in range(args.rounds):
                ids = [rng.randrange(10, 2000) for _ in range(n)]
                order = [("mono", mono.url), *((m, s[2].url) for m, s in stacks.items())]
                for name, url in order if r % 2 == 0 else order[::-1]:
                    times[name].append(ttft(url, ids))
            med = {k: statistics.median(v) * 1000 for k, v in times.items()}
            out[str(n)] = {
                "mono_ms": med["mono"],
                "whole_ms": med["whole"],
                "layer_ms": med["layer"],
                "whole_ratio": med["whole"] / med["mono"],
                "layer_ratio": med["layer"] / med["mono"],
                "rounds_ms": {k: [round(x * 1000, 1) for x in v] for k, v in times.items()},
            }
            print(f"{'limited' if limited else 'loopback'} {n}: {out[str(n)]}", flush=True)
        moved = {m: settled_bytes(s[0].url) - base[m] for m, s in stacks.items()}
        out["bytes_moved"] = moved
        out["bytes_identical"] = moved["whole"] == moved["layer"]
        return out
    finally:
        for s in stacks.values():
            for p in reversed(s):
                p.stop()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, link in zip(axes, ("loopback", "limited"), strict=True):
        sizes = [s for s in result[link] if s.isdigit()]
        x = range(len(sizes))
        ax.bar([i - 0.2 for i in x], [result[link][s]["whole_ratio"] for s in sizes], 0.4, label="whole-request")
        ax.bar([i + 0.2 for i in x], [result[link][s]["layer_ratio"] for s in sizes], 0.4, label="layer-wise")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.03, color="r", lw=0.8, ls="--", label="target 1.03x")
        ax.set_xticks(list(x), sizes)
        ax.set_xlabel("prompt tokens")
        ax.set_title(link if link == "loopback" else f"limited ({result['rate']})")
    axes[0].set_ylabel("TTFT P/D / monolithic")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--rate", default="500mbit", help="tc tbf rate of the limited link")
    p.add_argument("--links", nargs="+", default=["loopback", "limited"])
    args = p.parse_args()
    from disagg_worker.model.tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="bench-layerwise-"))
    model = str(make_tiny(work / "model", overrides=MODEL_SHAPE))
    secret = work / "secret"
    secret.write_text("bench-layerwise-secret\n")
    from disagg_worker import keys

    WORKER_TOKEN["value"] = keys.derive(keys.read_secret(str(secret), "--auth-token-file"), keys.WORKER)
    result: dict = {"rate": args.rate, "rounds": args.rounds, "model": MODEL_SHAPE}
    result["kv_bytes_per_token"] = KV_BYTES_PER_TOKEN
    mono = Proc(
        [
            DISAGG,
            "serve",
            "--model",
            model,
            "--port",
            str(port := free_port()),
            *engine_flags(max(args.sizes)),
            "--served-model-name",
            "tiny",
        ],
        f"http://127.0.0.1:{port}",
    )
    try:
        mono.wait_healthy()
        for link in args.links:
            if link == "limited":
                link_up(args.rate)
            try:
                result[link] = run_link(args, model, str(secret), mono, link == "limited")
            finally:
                if link == "limited":
                    link_down()
    finally:
        mono.stop()
    rate_bps = bits_per_second(args.rate)
    if rate_bps and "limited" in result:
        for n in args.sizes:
            r = result["limited"][str(n)]
            r["transfer_over_compute"] = n * KV_BYTES_PER_TOKEN * 8 / rate_bps / (r["mono_ms"] / 1000)
    limited = result.get("limited", {})
    result["target"] = {
        str(n): {
            "layer": limited[str(n)]["layer_ms"],
            "mono": limited[str(n)]["mono_ms"],
            "ratio": limited[str(n)]["layer_ratio"],
        }
        for n in args.sizes
        if str(n) in limited and n >= 4096
    }
    result["machine"] = machine_info()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "layerwise.json").write_text(json.dumps(result, indent=2) + "\n")
    if "loopback" in result and "limited" in result:
        plot(result, RESULTS / "layerwise.png")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
