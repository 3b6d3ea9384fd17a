"""Decode's quarantine and its trust in bootstrap targets, in one process with a scripted transfer backend:
pages a failed transfer may still write stay out of the free list until prefill says it is quiet, and a
request naming a target the router did not sign is refused before any receiver exists."""

from __future__ import annotations

import itertools
from dataclasses import replace

from disagg_worker.config import CacheConfig, DisaggConfig, EngineConfig, Role, SchedulerConfig
from disagg_worker.disagg import KVManager, KVPoll, KVReceiver, TransferFailure
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.instance.loop import Stepper
from disagg_worker.keys import TARGET, derive, sign_target
from disagg_worker.request import messages as msg
from disagg_worker.request.params import SamplingParams

ROOMS = itertools.count(7000)


class ScriptedReceiver(KVReceiver):
    def __init__(self, room: int):
        self.room = room
        self.status = KVPoll.WaitingForInput
        self.pages: list[int] = []
        self.skip_pages = 0
        self.unsafe = False

    def poll(self) -> KVPoll:
        return self.status

    def init(self, dest_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        self.pages, self.skip_pages = list(dest_pages), skip_pages
        self.status = KVPoll.Transferring

    def abort(self, reason: str = "aborted by decode") -> None:
        self.status = KVPoll.Failed

    def failure(self) -> TransferFailure | None:
        return TransferFailure("prefill timed out", self.unsafe) if self.status is KVPoll.Failed else None

    def aux_bytes(self) -> bytes:
        return bytes(16)


class ScriptedKV(KVManager):
    def __init__(self, cfg: DisaggConfig):
        self.cfg, self.role = cfg, Role.DECODE
        self.receivers: list[ScriptedReceiver] = []
        self.on_change = lambda: None

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        self.receivers.append(ScriptedReceiver(room))
        return self.receivers[-1]

    def close(self) -> None:
        pass


def decode_engine(model: str, secret: str = "", **options: bool) -> tuple[Engine, ScriptedKV]:
    disagg = DisaggConfig(role=Role.DECODE, transfer_backend="fake", auth_token=secret, **options)
    cfg = EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=4, max_total_tokens=256),
        scheduler=SchedulerConfig(chunk_size=8, max_running_requests=4, enable_overlap=False),  # stepped in turn
        disagg=disagg,
    )
    engine = load_engine(cfg)
    assert engine.stage is not None
    kv = ScriptedKV(disagg)
    engine.stage.kv = kv  # type: ignore[attr-defined]  # the decode stage's transfer backend, replaced by a script
    return engine, kv


def submit(engine: Engine, rid: str, info: msg.BootstrapInfo) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.handle(msg.GenerateReq(rid, list(range(10, 30)), params, info))


def test_pages_a_failed_transfer_may_still_write_stay_out_of_the_free_list_until_prefill_is_quiet(tiny_model):
    engine, kv = decode_engine(tiny_model)
    free = engine.allocator.num_free
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    try:
        submit(engine, "r", msg.BootstrapInfo("10.0.0.7", 8998, next(ROOMS)))
        stepper.step()
        (receiver,) = kv.receivers
        assert receiver.pages and engine.allocator.num_free == free - len(receiver.pages)
        receiver.status, receiver.unsafe = KVPoll.Failed, True  # prefill's writes may still land
        for _ in range(20):
            stepper.step()
        outs = engine.take_outputs()
        assert [o.error_status for o in outs] == [500] and "KV transfer failed" in outs[0].error
        assert engine.allocator.num_free == free - len(receiver.pages), "quarantined pages were handed out"
        receiver.unsafe = False  # prefill confirmed that nothing more lands
        stepper.step()
        assert engine.allocator.num_free == free
    finally:
        engine.executor.close()  # its forward thread
        engine.close()


def test_only_targets_the_router_signed_are_contacted(tiny_model):
    engine, kv = decode_engine(tiny_model, secret="s3cret")
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    key = derive("s3cret", TARGET)
    try:
        room = next(ROOMS)
        forged = msg.BootstrapInfo("10.6.6.6", 8998, room, sign_target(key, "10.0.0.7", 8998, room))
        for rid, info in [("unsigned", replace(forged, sig="")), ("forged", forged)]:
            submit(engine, rid, info)
        stepper.step()
        outs = {o.rid: o for o in engine.take_outputs()}
        assert {rid: o.error_status for rid, o in outs.items()} == {"unsigned": 403, "forged": 403}
        assert "not signed by this model's router" in outs["forged"].error
        assert kv.receivers == [], "a receiver was created for a target nobody signed"
        submit(engine, "signed", replace(forged, host="10.0.0.7"))
        stepper.step()
        assert [r.room for r in kv.receivers] == [room]
    finally:
        engine.executor.close()  # its forward thread
        engine.close()
