"""A worker's /metrics carries the gauges the Gateway API Inference Extension's endpoint pickers read for SGLang,
under SGLang's names, with what the scheduler reported."""

from prometheus_client.parser import text_string_to_metric_families

from disagg_worker.request import messages as msg
from disagg_worker.server.metrics import ServerMetrics


def samples(m: ServerMetrics) -> dict[str, tuple[dict, float]]:
    text = m.render().decode()
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_pickers_gauges_follow_the_schedulers_reports():
    m = ServerMetrics("decode-0")
    m.observe_info(page_size=16, num_pages=400)
    queues = {"decode_prealloc": 3, "decode_transfer": 2, "decode_quarantine": 0}
    m.observe_stats(msg.SchedulerStats(1.0, 5, 4, 100, 400, 0, 0, 7, queues=queues))
    got = samples(m)
    assert got["sglang:num_queue_reqs"] == ({"instance": "decode-0"}, 7.0)  # waiting 4 + prealloc 3
    assert got["sglang:num_running_reqs"] == ({"instance": "decode-0"}, 5.0)
    assert got["sglang:token_usage"] == ({"instance": "decode-0"}, 0.25)
    labels, value = got["sglang:cache_config_info"]
    assert (labels["page_size"], labels["num_pages"], value) == ("16", "400", 1.0)
    assert got["disagg_num_running_requests"][1] == 5.0  # the project's own names stay beside them
