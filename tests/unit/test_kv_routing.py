"""The cache-aware policy: a prefix goes where it is cached, a miss where the load is least (not to the biggest
cache), no worker is pinned while another idles, a worker whose index is silent is scored by load; the router
reads a prompt as the workers tokenise it."""

from __future__ import annotations

import time

from disagg_worker.mem.kv_events import EventLog, page_hashes
from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.router.policies import Policy
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.prompt import PromptTokens
from disagg_worker.router.worker import GroupPolicy, Worker
from disagg_worker.router.workers import WorkerPool

pytest_plugins = ["tests.unit.conftest_model"]
PAGE = 4
SYSTEM = list(range(100, 164))  # 16 pages
OTHER = list(range(500, 564))


def prompt(ids: list[int]) -> Prompt:
    return Prompt(len(ids), page_hashes(ids, PAGE), PAGE)


def pool_holding(held: dict[str, list[list[int]]]) -> tuple[WorkerPool, dict[str, Worker]]:
    """Prefill workers named by `held`, each indexed as holding the pages of its prompts, and one decode."""
    workers = {name: Worker(f"http://{name}", "prefill", 1, healthy=True) for name in held}
    pool = WorkerPool(static=[*workers.values(), Worker("http://d", "decode", healthy=True)], policy=Policy.CACHE_AWARE)
    for name, prompts in held.items():
        log = EventLog(PAGE, "m")
        log.apply(0, [("stored", page_hashes(ids, PAGE)) for ids in prompts])
        pool.kv_index.of(workers[name].url).apply(log.since("", -1), time.monotonic())
    return pool, workers


def test_a_prompt_goes_where_its_prefix_is_cached():
    pool, w = pool_holding({"a": [OTHER], "b": [SYSTEM]})
    assert pool.pick("prefill", prompt=prompt(SYSTEM + [7, 8, 9])) is w["b"]
    assert pool.pick("prefill", prompt=prompt(OTHER + [1])) is w["a"]
    assert pool.uncached(w["b"], prompt(SYSTEM + [7, 8, 9])) == 3
    assert pool.decisions == {"cache_hit": 2}


def test_a_miss_goes_to_the_least_loaded_worker_not_the_biggest_cache():
    pool, w = pool_holding({"big": [SYSTEM, OTHER], "small": []})
    w["big"].pending_tokens = 200
    miss = prompt(list(range(900, 940)))
    assert pool.pick("prefill", prompt=miss) is w["small"]
    w["big"].pending_tokens, w["small"].pending_tokens = 0, 200
    assert pool.pick("prefill", prompt=miss) is w["big"]
    assert pool.decisions == {"load": 2}


def test_a_stream_of_long_cached_prompts_does_not_pin_one_worker_while_another_idles():
    long = SYSTEM * 4 + [1]  # 257 tokens, 64 pages cached on a
    pool, w = pool_holding({"a": [long], "b": []})
    pool.balance_tokens = 100
    w["a"].pending_tokens, w["a"].inflight = 99, 2
    assert pool.pick("prefill", prompt=prompt(long)) is w["a"]  # 1 + 99 against 257: the cache wins
    w["a"].pending_tokens = 100
    assert pool.pick("prefill", prompt=prompt(long)) is w["b"]  # cheaper on a still, but a is at the guard and b idles
    w["b"].inflight = 1
    assert pool.pick("prefill", prompt=prompt(long)) is w["a"]  # nobody idles: cost decides again
    assert pool.decisions == {"cache_hit": 2, "balanced": 1}


def test_a_worker_whose_index_is_silent_is_scored_by_load_alone():
    pool, w = pool_holding({"a": [SYSTEM], "b": []})
    pool.kv_index.stale_after_s = 0.0  # every answer is already too old
    w["b"].pending_tokens = 10
    assert pool.kv_index.status(w["a"].url, time.monotonic() + 1)[0] == "silent"
    w["a"].pending_tokens = 20
    assert pool.pick("prefill", prompt=prompt(SYSTEM + [1])) is w["b"]  # its cache no longer counts


def test_decode_is_picked_by_load():
    pool, _ = pool_holding({"a": []})
    d1, d2 = pool.workers("decode")[0], Worker("http://d2", "decode", healthy=True)
    pool.static.append(d2)
    d1.inflight = 2
    assert pool.pick("decode") is d2
    # Another router's requests, as d2's /health reports them: more than this router has open on d1.
    d2.report = {"load": {"requests": 3, "kv_used": 10, "kv_total": 100}}
    assert d2.busy == 3 and pool.pick("decode") is d1
    # Equal requests held: the one with less of its KV in use.
    d1.report = {"load": {"requests": 3, "kv_used": 50, "kv_total": 100}}
    assert pool.pick("decode") is d2
    d2.report = {"load": {"requests": 3, "kv_used": 80, "kv_total": 100}}
    assert pool.pick("decode") is d1
    d1.report = {"load": {"requests": "3", "kv_used": True}}  # a malformed report counts as nothing
    assert (d1.busy, d1.kv_use) == (2, 0.0) and pool.pick("decode") is d1


def test_the_router_reads_prompts_as_the_workers_tokenise_them(tiny_dirs):
    tok = Tokenizer.from_path(tiny_dirs["llama"])
    prompts = PromptTokens(tok)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert prompts.ids("/v1/chat/completions", {"model": "x", "messages": messages}) == want
    assert prompts.ids("/v1/completions", {"model": "x", "prompt": "hello there"}) == tok.encode("hello there")
    assert prompts.ids("/v1/completions", {"model": "x", "prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompts.ids("/generate", {"input_ids": [1, 2, 3]}) == [1, 2, 3]
    assert prompts.ids("/generate", {"text": "hello there"}) == tok.encode("hello there")
    # A body the workers would refuse is routed by load (None), and left for the worker to answer.
    assert prompts.ids("/v1/chat/completions", {"model": "x", "messages": "not a list"}) is None
    assert prompts.ids("/generate", {"input_ids": [1], "text": "both"}) is None


def index(pool: WorkerPool, w: Worker, prompts: list[list[int]]) -> None:
    log = EventLog(PAGE, "m")
    log.apply(0, [("stored", page_hashes(ids, PAGE)) for ids in prompts])
    pool.kv_index.of(w.url).apply(log.since("", -1), time.monotonic())


def test_decode_computes_a_prompt_itself_when_it_lacks_no_more_than_the_threshold():
    pool, w = pool_holding({"a": [SYSTEM]})
    d = pool.workers("decode")[0]
    d.report = {"local_prefill": True}  # its /health says it computes prompts itself
    index(pool, d, [SYSTEM])
    pool.decode_only_tokens = 8
    assert pool.pick_pair(prompt=prompt(SYSTEM + list(range(8)))) == (None, d)  # lacks 8: decode alone
    assert pool.pick_pair(prompt=prompt(SYSTEM + list(range(9)))) == (w["a"], d)  # lacks 9: P/D
    assert pool.pick_pair(prompt=prompt(list(range(900, 906)))) == (None, d)  # a short prompt, nothing cached
    assert pool.pick_pair() == (w["a"], d)  # no prompt read (a readiness check): never decode alone
    assert pool.decisions["decode_only"] == 2
    pool.decode_only_tokens = 0
    assert pool.pick_pair(prompt=prompt(list(range(900, 906)))) == (w["a"], d)  # off
    pool.decode_only_tokens, d.report = 8, {}
    assert pool.pick_pair(prompt=prompt(list(range(900, 906)))) == (w["a"], d)  # a decode without --local-prefill


def test_a_follow_up_goes_back_to_the_decode_that_holds_its_history():
    pool, w = pool_holding({"a": []})
    d1 = pool.workers("decode")[0]
    d2 = Worker("http://d2", "decode", healthy=True)
    pool.static.append(d2)
    for d in (d1, d2):
        d.report = {"local_prefill": True}
    index(pool, d2, [SYSTEM])
    pool.decode_only_tokens = 8
    d2.inflight = 3  # busier, but the only one that can serve it alone
    assert pool.pick_pair(prompt=prompt(SYSTEM + [1, 2])) == (None, d2)
    assert pool.pick_pair(prompt=prompt(list(range(700, 764))))[1] is d1  # nobody holds it: P/D, decode by load


def test_a_decode_whose_index_is_silent_gets_only_prompts_short_enough_without_its_cache():
    pool, _ = pool_holding({"a": []})
    d = pool.workers("decode")[0]
    d.report = {"local_prefill": True}
    index(pool, d, [SYSTEM])
    pool.decode_only_tokens = 8
    pool.kv_index.stale_after_s = 0.0
    time.sleep(0.001)
    assert pool.pick_pair(prompt=prompt(SYSTEM + [1]))[0] is not None  # its cache no longer counts: P/D
    assert pool.pick_pair(prompt=prompt([1, 2, 3])) == (None, d)
    assert pool.indexed(d) and pool.indexed(pool.workers("prefill")[0])


def index_groups(pool: WorkerPool, w: Worker, groups: list[list[list[int]]]) -> None:
    """Index `w` as a worker with DP attention whose group g holds the pages of the prompts `groups[g]`."""
    w.report = {**w.report, "dp_loads": [0] * len(groups)}
    log = EventLog(PAGE, "m")
    for g, prompts in enumerate(groups):
        log.apply(g, [("stored", page_hashes(ids, PAGE)) for ids in prompts])
    pool.kv_index.of(w.url).apply(log.since("", -1), time.monotonic())


def test_under_dp_attention_a_prompt_runs_on_the_group_that_holds_its_prefix():
    pool, w = pool_holding({"a": []})
    p = w["a"]
    index_groups(pool, p, [[OTHER], [SYSTEM], []])
    follow_up = prompt(SYSTEM + [1, 2])
    assert pool.uncached(p, follow_up) == 2  # the worker is scored by its best group...
    assert pool.group_for(p, room=0, prompt=follow_up) == (1, 2)  # ...and the request runs there
    assert pool.group_for(p, room=0, prompt=prompt(OTHER + [3])) == (0, 1)
    # A miss goes to the least loaded group, by this router's pending tokens, then by the worker's report.
    p.add_tokens(30, 0)
    p.report["dp_loads"] = [0, 0, 5]
    assert pool.group_for(p, room=0, prompt=prompt([9] * 12)) == (1, 12)
    # Guard: group 1 at balance_tokens pending takes no more while group 2 idles, even for its own prefix; the
    # worker's choice, counted a cache hit, is then counted as balanced.
    pool.balance_tokens = 64
    p.add_tokens(64, 1)
    assert pool.pick("prefill", prompt=follow_up) is p and pool.decisions == {"cache_hit": 1}
    assert pool.group_for(p, room=0, prompt=follow_up) == (2, 66)
    assert pool.decisions == {"cache_hit": 0, "balanced": 1}
    p.release_tokens(64, 1)
    assert p.group_pending == {0: 30, 1: 0} and p.pending_tokens == 30
    assert pool.group_for(p, room=0, prompt=follow_up) == (1, 2)


def test_under_dp_attention_decode_takes_the_least_loaded_group_unless_it_computes_the_prompt_itself():
    pool, _ = pool_holding({"a": []})
    d = pool.workers("decode")[0]
    d.report = {"local_prefill": True}
    pool.decode_only_tokens = 8
    index_groups(pool, d, [[], [SYSTEM]])
    d.take(1)
    follow_up = prompt(SYSTEM + [1, 2])
    assert pool.group_for(d, room=1, prompt=follow_up) == (0, 0)  # KV comes from prefill: load first
    assert pool.group_for(d, room=1, prompt=follow_up, local=True) == (1, 2)  # decode alone: where its history is
    d.give_back(1)
    assert pool.group_for(d, room=0, prompt=follow_up) == (1, 0)  # equal load: the group holding more
    pool.group_policy = GroupPolicy.ROOM
    assert pool.group_for(d, room=0, prompt=follow_up) == (0, 0)  # the room picks a receiving decode's group...
    assert pool.group_for(d, room=0, prompt=follow_up, local=True) == (1, 2)  # ...never one computing alone


def test_a_prefix_below_a_workers_cache_counts_less_than_in_it_and_more_than_a_miss():
    """Host memory is the worker's own; the store is every worker's (written by one, read by all)."""
    pool, w = pool_holding({"cache": [], "host": [], "none": []})
    names = page_hashes(SYSTEM, PAGE)
    logs = {name: EventLog(PAGE, "m") for name in w}
    logs["cache"].apply(0, [("stored", names)])
    logs["host"].apply(0, [("stored", names[:4]), ("host_stored", names[4:])])
    logs["none"].apply(0, [("store_stored", names[:8])])
    for name, log in logs.items():
        pool.kv_index.of(w[name].url).apply(log.since("", -1), time.monotonic())
    p = prompt(SYSTEM + [7, 8, 9])
    assert pool.uncached(w["cache"], p) == 3
    # 4 pages cached, 12 in host memory at 0.8 of a cached page each.
    assert pool.uncached(w["host"], p) == len(p_ids := SYSTEM + [7, 8, 9]) - int((4 + 0.8 * 12) * PAGE)
    # "cache" wrote nothing to the store; "none" wrote 8 pages, which "cache" and "host" could read too.
    assert pool.uncached(w["none"], p) == len(p_ids) - int(0.6 * 8 * PAGE)
    assert pool.pick("prefill", prompt=p) is w["cache"]
    w["cache"].pending_tokens = 1000  # busy: the host tier's worker is next
    assert pool.pick("prefill", prompt=p) is w["host"]
    # Events move the index: host memory let the pages go.
    logs["host"].apply(0, [("host_removed", names[4:])])
    pool.kv_index.of(w["host"].url).apply(logs["host"].since(logs["host"].epoch, 2), time.monotonic())
    assert pool.uncached(w["host"], p) == len(p_ids) - int((4 + 0.6 * 4) * PAGE)  # then the store's pages 4..7
