"""DP attention as the HTTP process and the router see it: which attention group takes a request, the groups'
reports merged into the instance's, how the router picks a worker's group, and the settings refused at start-up."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg_worker import keys
from disagg_worker.config import ConfigError, DisaggConfig
from disagg_worker.request import messages as msg
from disagg_worker.request.errors import APIError
from disagg_worker.request.route import bootstrap_of
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.workers import GroupPolicy, Worker
from disagg_worker.server.groups import choose_group, group_problem, merge_exposition, merge_stats

BOOT = msg.BootstrapInfo("10.0.0.1", 8998, room=7)


def stats(dp: int, running: int, **kw) -> msg.SchedulerStats:
    base = dict(time=100.0 + dp, running=running, waiting=1, pages_used=3, pages_total=10, cache_hit_tokens=4)
    return msg.SchedulerStats(**{**base, "cache_query_tokens": 8, "step_count": 5 + dp, "dp_rank": dp, **kw})


def test_a_request_goes_to_the_group_it_names_else_prefill_follows_its_target_else_the_least_busy():
    assert choose_group(msg.Route(BOOT, 1), 2, [0, 9], prefill=True) == 1  # named
    assert choose_group(msg.Route(msg.BootstrapInfo("h", 1, 7, dp_rank=0)), 2, [0, 9], prefill=True) == 0
    assert choose_group(msg.Route(BOOT), 2, [3, 1], prefill=False) == 1  # decode: its own least busy group
    assert choose_group(msg.NO_ROUTE, 3, [2, 2, 2], prefill=False) == 0  # ties: the lowest


def test_a_group_that_does_not_exist_is_named_and_decode_does_not_check_prefills_group():
    assert group_problem(msg.Route(None, 2), 2, prefill=False) == (
        "data_parallel_rank",
        "data_parallel_rank 2: this instance runs 2 attention groups",
    )
    far = msg.Route(msg.BootstrapInfo("h", 1, 7, dp_rank=3))
    assert group_problem(far, 2, prefill=True)[1] == "bootstrap_dp_rank 3: this instance runs 2 attention groups"
    assert group_problem(far, 1, prefill=False) == ("", "")  # the prefill instance's group, not decode's
    # A routed request that names no group could not be found by decode; one that names two is refused too.
    field, message = group_problem(msg.Route(BOOT), 2, prefill=True)
    assert field == "bootstrap_dp_rank" and "runs 2 attention groups" in message
    assert group_problem(msg.Route(BOOT), 1, prefill=True) == ("", "")
    two = msg.Route(msg.BootstrapInfo("h", 1, 7, dp_rank=0), dp_rank=1)
    assert group_problem(two, 2, prefill=True)[0] == "data_parallel_rank"


def test_the_groups_reports_sum_into_the_instances_and_keep_their_series_apart():
    text = '# HELP disagg_x_total X\n# TYPE disagg_x_total counter\ndisagg_x_total{side="a"} 2.0\n'
    parts = {1: stats(1, 2, metrics_text=text, queues={"decode_prealloc": 1}), 0: stats(0, 1, metrics_text=text)}
    merged = merge_stats(parts)
    assert (merged.running, merged.waiting, merged.pages_used, merged.pages_total) == (3, 2, 6, 20)
    assert merged.time == 100.0 and merged.step_count == 6 and merged.queues == {"decode_prealloc": 1}
    samples = [s for f in text_string_to_metric_families(merged.metrics_text) for s in f.samples]
    assert sorted((s.labels["dp_rank"], s.value) for s in samples) == [("0", 2.0), ("1", 2.0)]
    assert merge_stats({0: parts[0]}) is parts[0]
    assert merge_exposition({0: "", 1: ""}) == ""


def test_the_router_picks_a_group_by_its_own_open_requests_then_the_reported_load():
    w = Worker("http://w", "decode", report={"dp_loads": [5, 2]})
    assert w.pick_group(GroupPolicy.LOAD, room=0) == 1
    w.take(1)
    assert w.pick_group(GroupPolicy.LOAD, room=0) == 0  # one of ours open on group 1
    w.give_back(1)
    assert w.inflight == 0 and w.group_inflight == {1: 0}
    assert w.pick_group(GroupPolicy.ROOM, room=7) == 1
    for report in ({}, {"dp_loads": [3]}, {"dp_loads": ["x", 1]}):
        assert Worker("http://w", "decode", report=report).pick_group(GroupPolicy.LOAD, 0) is None


def test_the_target_signature_covers_prefills_group_and_a_clients_groups_are_dropped():
    auth = RouterAuth(target_key="k")
    fields = auth.target("10.0.0.1", 8998, 7, dp_rank=1)
    assert fields["bootstrap_dp_rank"] == 1
    info = msg.BootstrapInfo("10.0.0.1", 8998, 7, fields["bootstrap_sig"], dp_rank=1)
    assert info.address == "10.0.0.1:8998/dp/1"
    assert keys.target_signed("k", info.signed_host, 8998, 7, info.sig)
    moved = msg.BootstrapInfo("10.0.0.1", 8998, 7, fields["bootstrap_sig"], dp_rank=0)
    assert not keys.target_signed("k", moved.signed_host, 8998, 7, moved.sig)
    body = SharedBody.of({"prompt": "hi", "data_parallel_rank": 1, "bootstrap_dp_rank": 0})
    assert b"data_parallel_rank" not in body.tail and b"bootstrap_dp_rank" not in body.tail


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"tp_size": 2, "dp_size": 2}, "--dp-size 2 without --enable-dp-attention"),
        ({"tp_size": 4, "dp_size": 3, "enable_dp_attention": True}, "--dp-size 3 must divide --tp-size 4"),
        ({"tp_size": 2, "pp_size": 2, "dp_size": 2, "enable_dp_attention": True}, "one pipeline stage in one pod"),
        ({"dp_size": 0}, "--dp-size 0: at least 1"),
    ],
)
def test_settings_that_cannot_work_stop_the_start_up_naming_the_flag(kw, message):
    with pytest.raises(ConfigError, match=message):
        DisaggConfig(**kw)
    assert DisaggConfig(tp_size=4, dp_size=2, enable_dp_attention=True).attn_tp_size == 2


def test_a_bootstrap_host_holding_a_slash_is_refused_so_a_signed_group_cannot_be_read_as_a_host():
    """The router signs host and group as "host/dp/k": were "h/dp/1" a host, a target signed for group 1 of h:8998
    would also sign h/dp/1 itself, which decode would reach on another port (http://h/dp/1:8998)."""
    body = {"bootstrap_host": "h/dp/1", "bootstrap_port": 8998, "bootstrap_room": 7}
    with pytest.raises(APIError) as e:
        bootstrap_of(body)
    assert e.value.status == 400
    assert bootstrap_of({**body, "bootstrap_host": "h", "bootstrap_dp_rank": 1}).address == "h:8998/dp/1"
