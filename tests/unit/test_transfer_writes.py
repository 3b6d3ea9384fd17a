"""WriteGroup: bounded submission, oldest-first polling, and what a failed write does to the rest
(against a scripted engine: each write finishes when the test says so); the engine's TCP lanes;
large writes split into pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.disagg.mooncake.engine import WriteGroup, WriteState
from disagg_worker.disagg.mooncake.prefill_writes import split_writes
from disagg_worker.tuning import TUNING


class ScriptedEngine:
    """Handles are 1, 2, ...; a write stays PENDING until `finish(handle, ok)`."""

    def __init__(self):
        self.submitted: list[tuple[int, int, int]] = []
        self.states: dict[int, WriteState] = {}

    def submit(self, peer: str, src: int, dst: int, nbytes: int) -> int:
        self.submitted.append((src, dst, nbytes))
        handle = len(self.submitted)
        self.states[handle] = WriteState.PENDING
        return handle

    def check(self, handle: int) -> WriteState:
        return self.states[handle]

    def finish(self, handle: int, ok: bool = True) -> None:
        self.states[handle] = WriteState.DONE if ok else WriteState.FAILED


WRITES = [(i, 100 + i, 8) for i in range(10)]


def test_writes_are_submitted_within_the_limit_in_order_and_the_group_settles_after_the_last():
    eng, group = ScriptedEngine(), WriteGroup(list(WRITES), 80)
    assert group.submit(eng, "peer", 4) == 4 and group.in_flight == 4
    assert eng.submitted == WRITES[:4]
    for h in (1, 2):
        eng.finish(h)
    assert group.poll(eng) is WriteState.PENDING and group.in_flight == 2
    assert group.submit(eng, "peer", 2) == 2 and eng.submitted == WRITES[:6]
    assert group.submit(eng, "peer", 0) == 0
    assert group.submit(eng, "peer", 100) == 4 and eng.submitted == WRITES
    for h in range(3, 11):
        eng.finish(h)
    assert not group.settled
    assert group.poll(eng) is WriteState.DONE and group.settled and group.in_flight == 0


def test_a_group_with_unsubmitted_writes_is_not_done_even_when_every_submitted_write_is():
    eng, group = ScriptedEngine(), WriteGroup(list(WRITES), 80)
    group.submit(eng, "peer", 3)
    for h in (1, 2, 3):
        eng.finish(h)
    assert group.poll(eng) is WriteState.PENDING and not group.settled


def test_after_a_failure_nothing_more_is_submitted_and_the_group_settles_when_the_submitted_ones_have():
    eng, group = ScriptedEngine(), WriteGroup(list(WRITES), 80)
    group.submit(eng, "peer", 3)
    eng.finish(1, ok=False)
    assert group.poll(eng) is WriteState.FAILED
    assert group.submit(eng, "peer", 10) == 0 and len(eng.submitted) == 3
    assert not group.settled  # writes 2 and 3 may still land
    eng.finish(2)
    eng.finish(3)
    assert group.poll(eng) is WriteState.FAILED and group.settled


def test_dropping_the_unsubmitted_writes_of_a_failed_room():
    eng, group = ScriptedEngine(), WriteGroup(list(WRITES), 80)
    group.submit(eng, "peer", 2)
    group.drop_unsubmitted()
    assert group.submit(eng, "peer", 10) == 0
    eng.finish(1)
    eng.finish(2)
    assert group.poll(eng) is WriteState.DONE and group.settled


def test_an_empty_group_is_settled_at_once():
    eng, group = ScriptedEngine(), WriteGroup([], 0)
    assert group.submit(eng, "peer", 5) == 0
    assert group.poll(eng) is WriteState.DONE and group.settled


class _RecordingEngine:
    """Stands in for Mooncake's TransferEngine: records the lanes it would start with."""

    lanes: list[str | None] = []

    def initialize(self, host, metadata, protocol, device):
        import os

        self.lanes.append(os.environ.get("MC_TCP_LANES_PER_PEER"))
        return 0

    def get_rpc_port(self):
        return 1234


def _disagg_config(argv: list[str], environ: dict[str, str]):
    """The DisaggConfig a prefill instance started with `argv` in `environ` gets."""
    import argparse

    from disagg_worker.cli_args import add_disagg_args, add_engine_args, server_args_from_cli
    from disagg_worker.config import Role
    from disagg_worker.env import load_env

    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_disagg_args(p)
    return server_args_from_cli(p.parse_args(["--model", "m", *argv]), Role.PREFILL, load_env(environ)).engine.disagg


def test_tcp_lanes_are_set_for_mooncake_unless_the_user_set_them(monkeypatch):
    """As the scheduler process starts: mooncake_environ(cfg) applied, then the engine built."""
    from disagg_worker.disagg.mooncake import engine
    from disagg_worker.disagg.mooncake.environ import mooncake_environ

    def start_engine(environ: dict[str, str]) -> None:
        cfg = _disagg_config(["--tcp-lanes", "8"], environ)
        assert cfg.tcp_lanes == 8
        for name, value in mooncake_environ(cfg).items():
            monkeypatch.setenv(name, value)
        engine.MooncakeEngine("127.0.0.1", "tcp", "")

    monkeypatch.setattr(engine, "_import_engine", lambda: _RecordingEngine)
    monkeypatch.delenv("MC_TCP_LANES_PER_PEER", raising=False)
    _RecordingEngine.lanes = []
    start_engine({})
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "2")  # the user's own setting wins
    start_engine({"MC_TCP_LANES_PER_PEER": "2"})
    assert _RecordingEngine.lanes == ["8", "2"]


def test_the_scheduler_process_sets_the_engine_environment_before_it_builds_the_engine(monkeypatch):
    import os

    import pytest
    import torch

    from disagg_worker.config import EngineConfig
    from disagg_worker.instance import process

    class Built(Exception):
        pass

    seen: list[str | None] = []

    class RecordingEngine:
        @classmethod
        def from_config(cls, cfg):
            seen.append(os.environ.get("MC_TCP_LANES_PER_PEER"))
            raise Built

    monkeypatch.setattr(process.signal, "signal", lambda *args: None)  # leave this process's handlers alone
    monkeypatch.setattr(process, "build_engine", RecordingEngine.from_config)
    monkeypatch.delenv("MC_TCP_LANES_PER_PEER", raising=False)
    disagg = _disagg_config(["--tcp-lanes", "8"], {})
    cfg = EngineConfig(model_path="m", torch_threads=torch.get_num_threads(), disagg=disagg)
    with pytest.raises(Built):
        process.run_scheduler(cfg, "ipc://unused-in", "ipc://unused-out")
    assert seen == ["8"]


def test_mooncake_environ_is_empty_where_no_mooncake_tcp_engine_starts():
    from dataclasses import replace

    from disagg_worker.config import Role
    from disagg_worker.disagg.mooncake.environ import mooncake_environ

    cfg = _disagg_config([], {})
    assert mooncake_environ(cfg) == {"MC_TCP_LANES_PER_PEER": "16"}
    assert mooncake_environ(replace(cfg, transfer_protocol="rdma")) == {}
    assert mooncake_environ(replace(cfg, transfer_backend="fake")) == {}
    assert mooncake_environ(replace(cfg, role=Role.MONOLITHIC)) == {}
    assert mooncake_environ(replace(cfg, tcp_lanes=0)) == {}
    assert mooncake_environ(_disagg_config(["--tcp-lanes", "0"], {"MC_TCP_LANES_PER_PEER": "3"})) == {
        "MC_TCP_LANES_PER_PEER": "3"
    }


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 4 << 20)), max_size=12),
    st.integers(0, 8),
    st.integers(0, 1 << 20),
)
def test_split_writes_covers_the_same_bytes_in_order_in_about_the_asked_pieces(writes, pieces, min_piece):
    out = split_writes(writes, pieces, min_piece)
    pieces = pieces or TUNING.transfer.write_pieces
    min_piece = min_piece or TUNING.transfer.min_piece_nbytes
    piece = max(min_piece, -(-sum(n for *_, n in writes) // pieces))
    rest = iter(out)
    for src, dst, n in writes:  # each write's pieces follow each other, from its first byte to its last
        off = 0
        while off < n:
            s, d, m = next(rest)
            assert (s, d) == (src + off, dst + off) and 0 < m <= piece
            off += m
        assert off == n
    assert next(rest, None) is None
    assert len(out) <= len(writes) + pieces


def test_split_writes_examples():
    mib = 1 << 20
    assert split_writes([(0, 100, 4 * mib)], 4) == [(i * mib, 100 + i * mib, mib) for i in range(4)]
    assert split_writes([(0, 100, 4 * mib)], 1) == [(0, 100, 4 * mib)]
    assert split_writes([(0, 100, 4096)], 4) == [(0, 100, 4096)]  # small writes stay whole
