"""Layer-wise KV streaming's pure parts: the layer groups, each group's buffers, what a send still writes once
streams sent the model's layers, and when a forward's transfer is known to be hidden."""

from __future__ import annotations

import threading

import pytest

from disagg_worker.disagg.layerwise import (
    LayerStream,
    StreamRound,
    layer_buffers,
    plan_groups,
    split_streamed,
    unstreamed_parts,
)
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.env import load_env


@pytest.mark.parametrize(
    "layers,size,groups",
    [
        (12, 4, [range(0, 4), range(4, 8), range(8, 9), range(9, 10), range(10, 11), range(11, 12)]),
        (10, 4, [range(0, 4), range(4, 8), range(8, 9), range(9, 10)]),  # the last group is shorter
        (3, 4, [range(0, 1), range(1, 2), range(2, 3)]),  # a pipeline stage with fewer layers than a group
        (2, 1, [range(0, 1), range(1, 2)]),
        (0, 4, []),
    ],
)
def test_groups_cover_every_layer_once_in_order(layers, size, groups):
    assert plan_groups(layers, size) == groups
    assert [i for g in plan_groups(layers, size) for i in g] == list(range(layers))


def test_a_group_holds_at_least_one_layer():
    with pytest.raises(ValueError, match="at least one layer"):
        plan_groups(4, 0)


def test_a_group_names_its_k_and_v_buffers_or_its_latents():
    # Buffers of a 4-layer pool: K0 K1 K2 K3 V0 V1 V2 V3 (MHA), C0 C1 C2 C3 (MLA latent).
    assert layer_buffers(range(1, 3), 4, 2) == [1, 2, 5, 6]
    assert layer_buffers(range(1, 3), 4, 1) == [1, 2]
    every = sorted(b for g in plan_groups(4, 3) for b in layer_buffers(g, 4, 2))
    assert every == list(range(8))  # the groups together write every buffer exactly once
    assert layer_buffers(range(4, 4), 4, 2) == []  # no draft layers: nothing


@pytest.mark.parametrize(
    "first,count,streamed,split",
    [(0, 5, 5, (5, 0)), (0, 5, 0, (0, 5)), (3, 5, 5, (2, 3)), (6, 2, 5, (0, 2)), (0, 0, 3, (0, 0))],
)
def test_a_send_splits_at_the_stream_cursor(first, count, streamed, split):
    assert split_streamed(first, count, streamed) == split


def test_a_send_of_streamed_pages_writes_only_the_layers_no_stream_sent():
    pages = [7, 8, 9, 10]
    assert unstreamed_parts(0, pages, 4, []) == []  # every layer streamed, no draft layers: nothing left
    assert unstreamed_parts(0, pages, 4, [8, 9]) == [(0, pages, [8, 9])]  # a draft model's layers
    assert unstreamed_parts(0, pages, 0, [8, 9]) == [(0, pages, None)]  # never streamed: every buffer
    assert unstreamed_parts(2, pages, 4, []) == [(2, [9, 10], None)]  # half streamed, half whole
    assert unstreamed_parts(2, pages, 4, [8]) == [(0, [7, 8], [8]), (2, [9, 10], None)]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_hidden_share_is_the_transfer_span_that_ran_before_the_forward_ended():
    metrics, clock = TransferMetrics("test-hidden"), Clock()
    rnd = StreamRound(metrics, clock)
    rnd.queued(2)  # t=100: the first group's writes
    clock.t = 101
    rnd.settled(100.0)
    clock.t = 104
    rnd.forward_ended()
    assert rnd.hidden_share() is None  # a group is still on the wire
    clock.t = 105
    rnd.settled(103.0)
    assert rnd.hidden_share() == pytest.approx(0.8)  # 4 s of a 5 s transfer ran under the forward
    assert metrics.last_hidden_share == pytest.approx(0.8) and metrics.groups_sent == 2


def test_a_transfer_done_before_the_forward_ended_is_wholly_hidden():
    metrics, clock = TransferMetrics("test-hidden-all"), Clock()
    rnd = StreamRound(metrics, clock)
    rnd.queued(1)
    clock.t = 101
    rnd.settled(100.0)
    clock.t = 103
    rnd.forward_ended()
    assert rnd.hidden_share() == 1.0 and metrics.last_hidden_share == 1.0


def test_armed_rooms_send_each_group_once_at_its_last_layer_and_the_rest_when_the_forward_ends():
    stream = LayerStream(5, 2, TransferMetrics("test-stream"))
    sent: list[tuple[str, range]] = []
    stream.layer_done(1)  # nothing armed: nothing sent
    stream.arm(lambda layers, event, rnd: sent.append(("a", layers)))
    stream.arm(lambda layers, event, rnd: sent.append(("b", layers)))
    assert stream.armed
    stream.layer_done(0)
    assert sent == []  # the group [0, 2) is not done yet
    stream.layer_done(1)
    assert sent == [("a", range(0, 2)), ("b", range(0, 2))]
    stream.forward_done()  # a forward that announced no further layer: the groups left go now
    assert sent[2:] == [("a", range(2, 4)), ("b", range(2, 4)), ("a", range(4, 5)), ("b", range(4, 5))]
    assert not stream.armed
    stream.layer_done(1)
    assert len(sent) == 6  # disarmed after its forward


def test_a_forward_that_raised_sends_nothing_more():
    stream = LayerStream(4, 2, TransferMetrics("test-stream-raise"))
    sent: list[range] = []
    stream.arm(lambda layers, event, rnd: sent.append(layers))
    stream.layer_done(1)
    stream.disarm()
    stream.forward_done()
    assert sent == [range(0, 2)]


def test_the_stall_hook_holds_a_streamed_forward_after_its_group_until_the_release_file_exists(tmp_path):
    release = tmp_path / "release"
    env = load_env({"DISAGG_FAULT_STALL_AFTER_LAYER_GROUP": f"0:{release}"})
    stream = LayerStream(4, 2, TransferMetrics("test-stream-stall"), stall=env.fault_stall_after_layer_group)
    sent: list[range] = []
    stream.layer_done(1)  # nothing armed: not a streamed forward, no stall
    stream.arm(lambda layers, event, rnd: sent.append(layers))
    forward = threading.Thread(target=lambda: [stream.layer_done(1), stream.layer_done(3), stream.forward_done()])
    forward.start()
    forward.join(0.3)
    assert forward.is_alive() and sent == [range(0, 2)]  # the first group left, the forward holds before the next
    release.touch()
    forward.join(5)
    assert not forward.is_alive() and sent == [range(0, 2), range(2, 3), range(3, 4)]  # the last group layer-wise
    assert load_env({}).fault_stall_after_layer_group == (-1, "")
