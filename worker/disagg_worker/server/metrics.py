"""Prometheus metrics of one server instance (its own registry, so several can share a process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from disagg_worker.request import messages as msg

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self, instance: str, role: str = "monolithic", max_loras: int = 0):
        """`max_loras`: the instance's --max-loras when it serves LoRA adapters (0: none, and no LoRA gauge)."""
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["instance"]
        self.instance = instance
        self.scheduler_text = ""
        # The instance's role, for dashboards and alerts to join onto its other series (`on(job, instance)`).
        Gauge("disagg_instance_info", "1, labelled with the instance's role", ["instance", "role"], registry=r).labels(
            instance, role
        ).set(1)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(instance)

        self.running = gauge("disagg_num_running_requests", "Requests in the running batch")
        self.waiting = gauge("disagg_num_waiting_requests", "Requests waiting for admission")
        self.pages_used = gauge("disagg_kv_pages_used", "KV cache pages in use")
        self.pages_free = gauge("disagg_kv_pages_free", "KV cache pages free")
        self.hit_rate = gauge("disagg_prefix_cache_hit_rate", "Prefix cache hit tokens / queried tokens")
        self.queue = Gauge(
            "disagg_queue_size",
            "Requests per disaggregation queue, per rank of the instance",
            ["instance", "queue", "tp_rank", "pp_rank"],
            registry=r,
        )

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(instance)

        self.ttft = histogram("disagg_time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("disagg_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("disagg_e2e_request_latency_seconds", "Request latency")
        self.prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens processed", labels, registry=r).labels(
            instance
        )
        self.generation_tokens = Counter("disagg_generation_tokens", "Tokens generated", labels, registry=r).labels(
            instance
        )
        self.requests = Counter("disagg_requests", "Requests finished", labels, registry=r).labels(instance)
        self.gie = PickerGauges(r, instance)
        self.lora = LoraGauges(r, instance, max_loras) if max_loras else None
        self.probes = Counter(
            "disagg_probe_requests", "Router pair probes served (not in the request metrics)", labels, registry=r
        ).labels(instance)

    def observe_stats(self, s: msg.SchedulerStats) -> None:
        self.scheduler_text = s.metrics_text
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.pages_used.set(s.pages_used)
        self.pages_free.set(s.pages_total - s.pages_used)
        if s.cache_query_tokens:
            self.hit_rate.set(s.cache_hit_tokens / s.cache_query_tokens)
        self.gie.observe(s)
        if self.lora is not None:
            self.lora.observe(s)
        ranks = s.rank_queues or {(0, 0): s.queues}
        for (tp, pp), queues in ranks.items():
            for name, size in queues.items():
                self.queue.labels(self.instance, name, str(tp), str(pp)).set(size)

    def observe_info(self, page_size: int, num_pages: int) -> None:
        self.gie.cache_config.labels(self.instance, str(page_size), str(num_pages)).set(1)

    def request_timer(self, prompt_tokens: int, probe: bool = False) -> RequestTimer:
        """Times one request; a router's probe only counts as a probe."""
        if probe:
            self.probes.inc()
            return UncountedTimer(self)
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry) + self.scheduler_text.encode()


class PickerGauges:
    """The gauges the Gateway API Inference Extension's model-server protocol reads, under the names its endpoint
    pickers (and llm-d's) use for SGLang, so that they score these pods unchanged: requests queued (waiting for
    admission, and in P/D for the KV handshake: prefill's bootstrap queue, decode's prealloc queue), requests
    running, the share of KV pages in use, and the KV cache's shape."""

    QUEUED = ("prefill_bootstrap", "decode_prealloc")

    def __init__(self, r: CollectorRegistry, instance: str):
        self.queued = Gauge("sglang:num_queue_reqs", "Requests queued (SGLang's name)", ["instance"], registry=r)
        self.running = Gauge("sglang:num_running_reqs", "Requests running (SGLang's name)", ["instance"], registry=r)
        self.usage = Gauge("sglang:token_usage", "Share of KV pages in use (SGLang's name)", ["instance"], registry=r)
        self.cache_config = Gauge(
            "sglang:cache_config_info",
            "The KV cache's page size and pages",
            ["instance", "page_size", "num_pages"],
            registry=r,
        )
        self.instance = instance

    def observe(self, s: msg.SchedulerStats) -> None:
        self.queued.labels(self.instance).set(s.waiting + sum(s.queues.get(q, 0) for q in self.QUEUED))
        self.running.labels(self.instance).set(s.running)
        self.usage.labels(self.instance).set(s.pages_used / s.pages_total if s.pages_total else 0.0)


class LoraGauges:
    """vLLM's `vllm:lora_requests_info`, under its name (which LoRA-aware endpoint pickers read) and the project's:
    one series, labelled with the adapters of the running requests and of the waiting ones (comma-separated names)
    and --max-loras, whose value is the time of the scheduler's report it follows. Only the latest labels are kept
    (vLLM keeps every set seen, each at the time it was last set; a reader takes the newest either way)."""

    NAMES = ("disagg_lora_requests_info", "vllm:lora_requests_info")
    LABELS = ("instance", "running_lora_adapters", "waiting_lora_adapters", "max_lora")

    def __init__(self, r: CollectorRegistry, instance: str, max_loras: int):
        doc = "The LoRA adapters of the running and the waiting requests, as of the value's time"
        self.gauges = [Gauge(name, doc, self.LABELS, registry=r) for name in self.NAMES]
        self.instance, self.max_loras = instance, str(max_loras)

    def observe(self, s: msg.SchedulerStats) -> None:
        labels = (self.instance, ",".join(s.lora_running), ",".join(s.lora_waiting), self.max_loras)
        for g in self.gauges:
            g.clear()
            g.labels(*labels).set(s.time)


class RequestTimer:
    def __init__(self, m: ServerMetrics):
        self.m = m
        self.start = self.last = time.monotonic()
        self.first = True

    def tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        (self.m.ttft if self.first else self.m.itl).observe(now - self.last if not self.first else now - self.start)
        self.first = False
        self.last = now
        self.m.generation_tokens.inc(n)

    def finish(self) -> None:
        self.m.e2e.observe(time.monotonic() - self.start)
        self.m.requests.inc()


class UncountedTimer(RequestTimer):
    """A timer that records nothing: for requests that are not user traffic."""

    def tokens(self, n: int) -> None:
        pass

    def finish(self) -> None:
        pass
