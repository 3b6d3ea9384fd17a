"""OpenTelemetry traces through router -> prefill -> KV transfer -> decode, read back from a real Jaeger.

Jaeger all-in-one (built from its Go module by `hack/jaeger/build.sh`, as `make test` does first) takes the three
processes' spans over OTLP/HTTP on free ports; the test reads one request's trace from its query API and checks
the spans each process made, their parents across the processes, that each lies inside its parent and that they
follow one another in the order of the request's life. Durations are not compared against a fixed slack: under
load the front ends' own work (parsing, the zmq hops, the exports) grows without bound, and three processes'
clocks are read at different moments; what the structure says holds on any machine.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.integration.procs import PDStack, free_port, scaled, wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192")
# Spans leave each process in batches this often (ms): the trace is complete soon after the request.
EXPORT_DELAY_MS = "100"
# Jaeger keeps microseconds and each process rounds its own clock readings: a span's end may read up to this much
# past its parent's (us).
ROUNDING_US = 1000


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory):
    binary = subprocess.run(
        [str(REPO / "hack/jaeger/build.sh")], check=True, capture_output=True, text=True
    ).stdout.splitlines()[-1]
    ports = {name: free_port() for name in ("admin", "grpc", "http", "otlp_grpc", "otlp_http", "query_grpc", "query")}
    flags = {
        "admin.http": "admin",
        "collector.grpc-server": "grpc",
        "collector.http-server": "http",
        "collector.otlp.grpc": "otlp_grpc",
        "collector.otlp.http": "otlp_http",
        "query.grpc-server": "query_grpc",
        "query.http-server": "query",
    }
    log = (tmp_path_factory.mktemp("jaeger") / "jaeger.log").open("w")
    proc = subprocess.Popen(
        [binary, *(f"--{flag}.host-port=127.0.0.1:{ports[name]}" for flag, name in flags.items())],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "SPAN_STORAGE_TYPE": "memory"},
    )
    query = f"http://127.0.0.1:{ports['query']}"
    wait_until(lambda: _get(f"{query}/api/services") is not None, 30, what="jaeger's query API")
    yield query, f"127.0.0.1:{ports['otlp_http']}"
    proc.kill()  # its storage is memory: nothing to keep (and its own gRPC exporter can hold up a SIGTERM)
    proc.wait()
    log.close()


@pytest.fixture(scope="module")
def stack(tiny_model, jaeger):
    _, otlp = jaeger
    tracing = ("--otlp-traces-endpoint", otlp)
    before = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS
    try:
        s = PDStack(tiny_model, *FLAGS, *tracing, router_flags=tracing).wait_healthy()
    finally:
        if before is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = before
    yield s
    s.stop()


def _get(url: str) -> dict | None:
    try:
        r = requests.get(url, timeout=5)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


def read_trace(query: str, trace_id: str, complete) -> dict:
    """The trace as Jaeger stored it (`raw`: without the query service's clock-skew adjustments, which would move
    a child into its parent) once `complete(spans by name)` holds: {span id: span}, each with its service."""
    found: dict = {}

    def fetch() -> bool:
        body = _get(f"{query}/api/traces/{trace_id}?raw=true")
        if not body or not body.get("data"):
            return False
        t = body["data"][0]
        found.clear()
        for s in t["spans"]:
            s["service"] = t["processes"][s["processID"]]["serviceName"]
            s["attrs"] = {tag["key"]: tag["value"] for tag in s["tags"]}
            found[s["spanID"]] = s
        return complete(by_name(found))

    wait_until(fetch, 30, what="the whole trace in jaeger")
    return found


def by_name(spans: dict) -> dict[str, list[dict]]:
    names: dict[str, list[dict]] = {}
    for s in sorted(spans.values(), key=lambda s: s["startTime"]):
        names.setdefault(f"{s['service']}:{s['operationName']}", []).append(s)
    return names


def parent_of(span: dict) -> str:
    return next((r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"), "")


def end(span: dict) -> int:
    return span["startTime"] + span["duration"]  # microseconds


PREFILL_STAGES = ("admission", "prefill.bootstrap", "scheduler.waiting", "forward", "kv.transfer")
DECODE_STAGES = ("admission", "decode.prealloc", "kv.transfer", "first_token", "decoding")
SERVER = "POST /v1/chat/completions"


def complete(names: dict) -> bool:
    wanted = [
        f"disagg-router:router {SERVER}",
        "disagg-router:attempt",
        *(f"disagg-prefill:{n}" for n in PREFILL_STAGES),
        *(f"disagg-decode:{n}" for n in DECODE_STAGES),
    ]
    return all(w in names for w in wanted)


def test_a_pd_request_is_one_trace_across_router_prefill_and_decode(stack, jaeger):
    query, _ = jaeger
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    prompt = " ".join(f"word{i}" for i in range(60))  # several 32-token chunks
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "ignore_eos": True, "stream": True}
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    start = time.monotonic()
    with requests.post(
        f"{stack.router.url}/v1/chat/completions", json=body, headers=headers, stream=True, timeout=scaled(60)
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    latency_us = (time.monotonic() - start) * 1e6
    assert events[-1] == b"data: [DONE]"

    spans = read_trace(query, trace_id, complete)
    names = by_name(spans)
    one = {name: found[0] for name, found in names.items()}

    # Each process made its spans under the one before it: client -> router -> attempt -> legs -> workers.
    root = one[f"disagg-router:router {SERVER}"]
    attempt = one["disagg-router:attempt"]
    assert parent_of(root) == client_span
    assert parent_of(one["disagg-router:admission"]) == root["spanID"]
    assert parent_of(attempt) == root["spanID"] and attempt["attrs"]["disagg.attempt"] == 0
    for role, stages in (("prefill", PREFILL_STAGES), ("decode", DECODE_STAGES)):
        leg = one[f"disagg-router:{role}"]
        server = one[f"disagg-{role}:{role} {SERVER}"]
        assert parent_of(leg) == attempt["spanID"]
        assert parent_of(server) == leg["spanID"], role
        for name in stages:
            for s in names[f"disagg-{role}:{name}"]:
                assert parent_of(s) == server["spanID"], (role, name)
                assert 0 <= s["duration"] < server["duration"], (role, name)
                assert server["startTime"] <= s["startTime"] and end(s) <= end(server) + ROUNDING_US, (role, name)
        # Across processes only what causality orders: the leg sent the request before the worker took it, and
        # the worker's stages produced the answer before the leg had read all of it (the worker's own span may
        # end after the leg: it closes once its last bytes are written, which the router may read first).
        last_stage = max(end(s) for name in stages for s in names[f"disagg-{role}:{name}"])
        assert leg["startTime"] <= server["startTime"] and last_stage <= end(leg) + ROUNDING_US, role

    # The transfer, as each side saw it.
    sent, received = one["disagg-prefill:kv.transfer"]["attrs"], one["disagg-decode:kv.transfer"]["attrs"]
    assert sent["status"] == received["status"] == "Success"
    assert (
        sent["pages"] >= received["pages"] > 0
        and received["bytes"] == sent["bytes"] // sent["pages"] * received["pages"]
    )
    assert sent["peer"] and received["peer"] == f"127.0.0.1:{stack.bootstrap_port}"
    forwards = names["disagg-prefill:forward"]
    prompt_tokens = one[f"disagg-prefill:prefill {SERVER}"]["attrs"]["disagg.prompt_tokens"]
    assert len(forwards) >= 3 and sum(f["attrs"]["tokens"] for f in forwards) == prompt_tokens
    decoding = one["disagg-decode:decoding"]["attrs"]
    assert decoding["finish_reason"] == "length" and decoding["output_tokens"] == 8
    assert one[f"disagg-decode:decode {SERVER}"]["attrs"]["disagg.finish_reason"] == "length"

    # Each level of the streamed answer's path lies inside the one above it: client > router > attempt > decode
    # leg > the time decode's stages cover, and decode's span > that time; prefill's stages cover part of its
    # span and no more (its KV transfer begins with the first chunk's pages and overlaps the later chunks'
    # forwards, so what is compared is the time at least one stage covers).
    covered = {}
    for role, stages in (("prefill", PREFILL_STAGES), ("decode", DECODE_STAGES)):
        server = one[f"disagg-{role}:{role} {SERVER}"]
        spans_of = [s for n in stages for s in names[f"disagg-{role}:{n}"]]
        covered[role] = union_us([(s["startTime"], end(s)) for s in spans_of])
        assert 0 < covered[role] <= server["duration"], (role, covered, server)
    # (Within the router, then within decode; between them the leg covers the time decode's stages cover.)
    chain = [latency_us, root["duration"], attempt["duration"], one["disagg-router:decode"]["duration"]]
    chain += [covered["decode"]]
    assert all(a + ROUNDING_US >= b for a, b in zip(chain, chain[1:], strict=False)), chain
    assert one[f"disagg-decode:decode {SERVER}"]["duration"] + ROUNDING_US >= covered["decode"], covered
    decode = [one[f"disagg-decode:{n}"] for n in DECODE_STAGES]
    for a, b in zip(decode, decode[1:], strict=False):
        assert end(a) <= b["startTime"] + ROUNDING_US, ("decode", a["operationName"], b["operationName"])
    prefill = [one[f"disagg-prefill:{n}"] for n in PREFILL_STAGES[:3]] + forwards
    for a, b in zip(prefill, prefill[1:], strict=False):
        assert a["startTime"] <= b["startTime"], ("prefill", a["operationName"], b["operationName"])
    transfer = one["disagg-prefill:kv.transfer"]
    assert end(forwards[0]) <= transfer["startTime"] + ROUNDING_US and end(transfer) >= end(forwards[-1])


def union_us(intervals: list[tuple[int, int]]) -> int:
    """How long at least one of the intervals covers."""
    total, reach = 0, None
    for start, stop in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + stop - start, stop
        elif stop > reach:
            total, reach = total + stop - reach, stop
    return total
