"""Tuning constants: values chosen by measurement or for a stated reason, not configuration.

They are not CLI flags: a user has no reason to change them, and each one carries the reason it
has its value (measured on the project's CI machine, 2 cores, loopback TCP, unless a comment
says otherwise). `TUNING` is the one instance the code reads. `Tuning` has one part per
subsystem: `engine` for the scheduler process's loop (`instance/loop.py`), `transfer` for KV
transfer (`disagg_worker.disagg`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineTuning:
    """The scheduler process's loop (`instance/loop.py`)."""

    # How often the loop reports its queues, pages and metrics to the HTTP process (/stats,
    # /metrics, /health's heartbeat), and the longest it sleeps on its inbox when idle: twice a
    # second keeps the gauges fresh for a 1 s scrape and far inside the 20 s after which the HTTP
    # process declares a silent scheduler stalled.
    stats_interval_s: float = 0.5
    # While requests wait on KV transfers, the loop also wakes this often for what no transfer
    # status move announces (pages freed by finished requests); status moves wake it at once.
    transfer_poll_ms: int = 1
    # A multi-rank instance with nothing to do still runs an empty step this often, so every rank hears from
    # the others: a dead rank breaks it at once, a hung one within --dist-timeout (`ranks/dist.py`).
    rank_heartbeat_s: float = 1.0
    # Compiling a request's grammar runs on a thread beside the loop; a request whose grammar is not compiled
    # within this limit is refused (400). Real schemas compile in milliseconds to ~1 s (xgrammar); the limit
    # stops a pathological one from holding its request for ever. A compilation cannot be cancelled: it goes
    # on, and its grammar is refused at once from then on.
    grammar_compile_limit_s: float = 10.0
    # Compiled grammars kept for reuse (least recently used dropped first): a compiled JSON schema holds up
    # to a few MB of token masks, so the bound keeps clients' schemas from growing the process without end.
    grammar_cache_entries: int = 128
    # Distinct grammars queued or compiling at once; a request whose grammar would be one more is refused at once
    # with a 503 (retry later), so a flood of new schemas holds no unbounded queue of compilations.
    grammar_queue_entries: int = 64


@dataclass(frozen=True)
class TransferTuning:
    """KV transfer between prefill and decode (`disagg_worker.disagg`)."""

    # ---- control plane -------------------------------------------------------------------------
    # The control threads of both managers wait at most this long for messages, and check their
    # rooms' timeouts at most this often: not on every message, since a sweep visits every room.
    sweep_interval_ms: int = 20
    # Decode hears "Transferring" only for sends still in flight after this long. The notice is
    # informational and costs a control message on both sides (~0.2 ms of CPU): long enough a wait
    # keeps it under 1% of the transfer it describes. With 5 ms, rooms streaming behind each other
    # each sent one, and streamed 1 MiB rooms moved ~5% slower.
    transferring_notice_s: float = 0.05
    # Ids of finished rooms remembered so that a late message for one is dropped, not attached to
    # a new request with the same id; the bound keeps their memory finite on a long-lived instance.
    max_tombstones: int = 200_000
    # Prefill registering with its bootstrap server: retry soon while the server is not up yet,
    # slowly when it refused the registration (a mismatch that waiting rarely fixes).
    register_retry_s: float = 0.2
    register_refused_retry_s: float = 5.0
    # Decode resolving a prefill instance whose bootstrap server is not complete yet.
    resolve_retry_s: float = 0.2
    # Longest wait for one heartbeat answer (`GET /health`); shorter heartbeat intervals wait less.
    heartbeat_timeout_s: float = 2.0
    # Prefill forgets a decode peer (releases its transfer thread and control socket) once it has
    # been silent this long with nothing in flight: a decode that is gone costs nothing after a
    # minute. Decode greets a prefill rank again before a request when it sent that rank nothing
    # for `hello_refresh_s`, well inside `peer_idle_s`, so a forgotten peer is known again before
    # its request is read. Prefill looks for idle peers every `peer_check_interval_s`.
    peer_idle_s: float = 60.0
    hello_refresh_s: float = 15.0
    peer_check_interval_s: float = 1.0

    # ---- writes (Mooncake) ---------------------------------------------------------------------
    # Per destination peer. Mooncake TCP queues at most ~1024 writes per peer; past that it rejects
    # writes, and after such a burst some queued ones never finish (3000 writes of 4 KiB submitted
    # at once left 1024 pending for good).
    max_writes_in_flight: int = 256
    # Mooncake TCP moves several writes to one peer at once (over its TCP lanes): a large write
    # split into about this many pieces lands sooner than in one piece (loopback: 1 MiB ~1.6x,
    # 16 MiB ~1.1x; 8 or 16 pieces for a 512 MiB room were inside the noise). Only done when
    # nothing else is in flight to the peer: with other writes queued the lanes are busy already
    # (32 x 1 MiB streamed: 1.94 GB/s as 32 writes vs 1.69 as 128).
    write_pieces: int = 4
    min_piece_nbytes: int = 256 << 10
    # Page lists this long or longer are grouped into runs with numpy; below, the plain loop wins.
    vectorise_from_pages: int = 256

    # ---- staging of fragmented destinations (Mooncake) -----------------------------------------
    # Mooncake TCP costs ~35 us per write: 1000 scattered 16 KiB pages move at a third of the speed
    # of one contiguous write. A destination is staged when it is fragmented: at least
    # `staging_min_runs` runs averaging under `staging_max_avg_run_pages` pages.
    staging_min_runs: int = 8
    staging_max_avg_run_pages: int = 4
    # Registered staging area per manager; rooms that do not fit are written page run by page run.
    staging_nbytes: int = 64 << 20

    # ---- transfer threads (Mooncake) -----------------------------------------------------------
    # Sleep between status polls: starts short (small transfers finish in tens of microseconds)
    # and doubles while nothing completes, up to the cap. The cap bounds how late a finished
    # transfer is noticed (a sleep overshoots by ~80 us here); a poll costs ~10 us of CPU.
    poll_sleep_min_s: float = 0.00001
    poll_sleep_max_s: float = 0.0002
    # Jobs to one peer are polled oldest first up to the first one still waiting; a full pass this
    # often finds one that finished out of order (streamed 32 x 1 MiB: 5.6 status polls per room
    # instead of 18.9).
    full_poll_interval_s: float = 0.002
    # Timer slack of a transfer thread: its sleeps end within ~1 us of their deadline instead of
    # the default 50 us (a 20 us sleep took ~120 us, ~40 us with this).
    timer_slack_ns: int = 1000


@dataclass(frozen=True)
class RouterTuning:
    # Longest wait for a worker's `GET /health` answer.
    health_timeout_s: float = 3.0
    # Health probes in a row that time out before a worker leaves rotation. A worker that answers 503 (draining,
    # a dead scheduler) or refuses the connection leaves at once; one that is merely slow to answer (a loaded
    # machine, a long tokenisation on its event loop) is not taken out for a single late answer.
    health_timeouts_to_unhealthy: int = 2
    # A stream stalled (--stream-stall-timeout): its decode is taken for stalled when none of its streams delivered
    # an event for this share of the timeout (`router/stall.py`). Not the whole timeout: a decode's streams stop
    # together but their last events arrive a step or two apart, so the stalled stream's own window opens with its
    # siblings' last events. A decode that makes progress delivers on some stream every step, milliseconds apart.
    stalled_decode_silence: float = 0.5
    # LoRA affinity (`WorkerPool.cold`): a request for an adapter goes to the instances of a role where it is
    # resident while the least busy of them holds at most this many requests more than the least busy instance that
    # serves it at all; beyond, to any (the adapter then loads there: a copy into a slot, and a wait for a free one).
    lora_affinity_slack: int = 8


@dataclass(frozen=True)
class RequestTuning:
    """Bounds on what one request may make a front end hold (the router, a worker's HTTP process)."""

    # Completions' echo with logprobs answers, per choice, every prompt token's logprob and its top-`logprobs`
    # alternatives: prompt tokens x (logprobs + 1) x n entries. The router holds each choice's prefill answer
    # whole (its JSON bytes, then the parsed objects) to fill decode's in: measured ~75-100 MB for one choice of a
    # 32k-token prompt at logprobs 20 (688k entries), so 110-150 bytes an entry. 2^18 entries keep one request to
    # ~40 MB (262144 x 150 B): a 32k prompt at logprobs 7 and n 1, or a 4k prompt at logprobs 5 and n 10, passes;
    # a 32k prompt at logprobs 20, or a 3k prompt at logprobs 5 and n 16, is a 400.
    echo_logprob_entries: int = 1 << 18


@dataclass(frozen=True)
class Tuning:
    engine: EngineTuning = field(default_factory=EngineTuning)
    transfer: TransferTuning = field(default_factory=TransferTuning)
    router: RouterTuning = field(default_factory=RouterTuning)
    request: RequestTuning = field(default_factory=RequestTuning)


TUNING = Tuning()
