"""A request's failure is that request's: the engine in-process, with failures injected into one request's own
steps (sampling, grammar compilation), and the edge's bounds on every sampling field.

Each test asserts what a client would see (the failed request's status, code and id; the others' tokens) and
that every page is accounted for afterwards.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

import pytest
import torch

from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import Sampler, SamplingState
from disagg_worker.request import messages as msg
from disagg_worker.request.errors import APIError
from disagg_worker.request.limits import RequestLimits
from disagg_worker.request.params import MAX_STOP_TOKEN_IDS, SamplingParams
from disagg_worker.server.protocol import parse_chat, parse_completions
from tests.timing import scaled
from tests.unit.test_engine import GREEDY, assert_idle_accounting, make_engine, tokens_of, varied_prompts

VOCAB = 50


class ExplodingMatcher:
    """A grammar matcher whose mask raises an exception no sampler expects."""

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask, row) -> None:
        raise KeyError("injected")


def run(engine: Engine, overlap: bool, prepare=lambda engine: None) -> dict[str, list[msg.TokenOut]]:
    from disagg_worker.instance.loop import Stepper

    assert engine.cfg.overlap == overlap  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    prepare(engine)
    outs: dict[str, list[msg.TokenOut]] = {}
    deadline = time.monotonic() + 60
    while stepper.busy:
        assert time.monotonic() < deadline, "the engine did not finish"
        stepper.step()
        for o in engine.take_outputs():
            outs.setdefault(o.rid, []).append(o)
    stepper.close()
    for o in engine.take_outputs():
        outs.setdefault(o.rid, []).append(o)
    assert_idle_accounting(engine)
    return outs


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_sampling_raises_fails_alone_and_the_batch_goes_on(tiny_model, overlap):
    prompts = varied_prompts(4)
    alone = run(
        make_engine(tiny_model, overlap=overlap),
        overlap,
        lambda e: e.handle(msg.GenerateReq("ok0", prompts[0], GREEDY)),
    )
    engine = make_engine(tiny_model, overlap=overlap)

    def prepare(e: Engine) -> None:
        for i, p in enumerate(prompts):
            e.handle(msg.GenerateReq(f"ok{i}" if i != 2 else "bad", p, GREEDY))
        e.scheduler.by_rid["bad"].sampling.matcher = ExplodingMatcher()

    outs = run(engine, overlap, prepare)
    last = outs["bad"][-1]
    assert (last.error_status, last.error_code, last.finish_reason) == (500, "internal_error", "error")
    assert "request id bad" in last.error and "KeyError" not in last.error
    assert tokens_of(outs["ok0"]) == tokens_of(alone["ok0"])
    assert all(len(tokens_of(outs[f"ok{i}"])) == GREEDY.max_new_tokens for i in (0, 1, 3))


def test_a_grammar_compiler_raising_an_unexpected_error_fails_that_request_with_500(tiny_model):
    engine = make_engine(tiny_model)
    engine.grammars.fault_pattern = "boom+"
    regex = dataclasses.replace(GREEDY, grammar='{"pattern": "boom+", "type": "regex"}')
    outs = run(
        engine,
        True,
        lambda e: [e.handle(msg.GenerateReq(rid, [5, 6, 7], p)) for rid, p in (("bad", regex), ("ok", GREEDY))],
    )
    bad = outs["bad"][-1]
    assert (bad.error_status, bad.error_code) == (500, "internal_error")
    assert "compiling its grammar" in bad.error and "request id bad" in bad.error
    assert len(tokens_of(outs["ok"])) == GREEDY.max_new_tokens


def test_a_grammar_whose_compilation_runs_past_the_limit_is_a_400_and_refused_at_once_afterwards(tiny_model):
    engine = make_engine(tiny_model)
    engine.grammar_wait.limit_s = 0.05
    real_submit = engine.grammars.submit
    engine.grammars.submit = lambda grammar: Future()  # type: ignore[method-assign] # a compilation that never ends
    engine.grammars.compiling_for = lambda grammar: 1.0  # type: ignore[method-assign] # running for a second
    slow = dataclasses.replace(GREEDY, grammar='{"pattern": "a+", "type": "regex"}')
    outs = run(
        engine, True, lambda e: [e.handle(msg.GenerateReq(r, [5, 6, 7], p)) for r, p in (("s", slow), ("ok", GREEDY))]
    )
    assert outs["s"][-1].error_status == 400
    assert outs["s"][-1].error.startswith("regex: the pattern did not compile within")
    assert len(tokens_of(outs["ok"])) == GREEDY.max_new_tokens
    engine.grammars.submit = real_submit  # type: ignore[method-assign]
    engine.grammar_wait.limit_s = scaled(60)  # a real compilation: its time is the machine's, not the test's
    again = run(engine, True, lambda e: e.handle(msg.GenerateReq("s2", [5, 6, 7], slow)))
    assert again["s2"][-1].error_status == 400 and "did not compile within" in again["s2"][-1].error


def test_a_grammar_queued_behind_slow_ones_is_a_503_and_not_held_against_it(tiny_model):
    engine = make_engine(tiny_model)
    engine.grammar_wait.limit_s = 0.05
    real_submit = engine.grammars.submit
    engine.grammars.submit = lambda grammar: Future()  # type: ignore[method-assign] # never given a thread
    queued = dataclasses.replace(GREEDY, grammar='{"pattern": "b+", "type": "regex"}')
    outs = run(engine, True, lambda e: e.handle(msg.GenerateReq("q", [5, 6, 7], queued)))
    assert outs["q"][-1].error_status == 503 and "busy" in outs["q"][-1].error
    engine.grammars.submit = real_submit  # type: ignore[method-assign]
    engine.grammar_wait.limit_s = scaled(60)  # a real compilation: its time is the machine's, not the test's
    again = run(engine, True, lambda e: e.handle(msg.GenerateReq("q2", [5, 6, 7], queued)))
    assert again["q2"][-1].error_status == 0 and again["q2"][-1].finish_reason in ("stop", "length")
    assert tokens_of(again["q2"])  # the grammar compiled this time: the 503 held nothing against it


def test_requests_with_the_same_grammar_share_one_compilation(tiny_model):
    engine = make_engine(tiny_model)
    grammar = '{"pattern": "ab+", "type": "regex"}'
    first, second = engine.grammars.submit(grammar), engine.grammars.submit(grammar)
    assert first is second
    first.result(timeout=60)
    assert engine.grammars.submit(grammar).done()  # cached from now on


def test_the_compiled_grammar_cache_is_bounded(tiny_model):
    engine = make_engine(tiny_model)
    engine.grammars.cache_entries = 2
    for pattern in ("a+", "b+", "c+", "d+"):
        engine.grammars.matcher(f'{{"pattern": "{pattern}", "type": "regex"}}')
    assert list(engine.grammars._compiled) == [
        '{"pattern": "c+", "type": "regex"}',
        '{"pattern": "d+", "type": "regex"}',
    ]


def test_the_engine_refuses_parameters_the_edge_would_refuse(tiny_model):
    """A request that reached the engine unchecked (the top_k of the query of death) is refused, never sampled."""
    engine = make_engine(tiny_model)
    deadly = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.5, top_k=10**30)
    outs = run(engine, True, lambda e: e.handle(msg.GenerateReq("q", [5, 6, 7], deadly)))
    assert outs["q"][-1].error_status == 400 and outs["q"][-1].error.startswith("top_k: must be at most")


LIMITS = RequestLimits(max_context_len=4096, vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"top_k": 10**30, "top_p": 0.5, "temperature": 1}, "top_k", "at most the vocabulary size (50)"),
        ({"top_k": VOCAB + 1}, "top_k", "at most the vocabulary size"),
        ({"logit_bias": {"50": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": [1]}, "logit_bias", "must be an object"),
        ({"logit_bias": {"5": 1e400}}, "logit_bias.5", "finite number"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", "at most 128 stop token ids"),
    ],
)
def test_sampling_fields_out_of_bounds_are_a_400_naming_the_field(extra, param, says):
    for parse, body in (
        (parse_completions, {"prompt": "hi", **extra}),
        (parse_chat, {"messages": [{"role": "user", "content": "hi"}], **extra}),
    ):
        with pytest.raises(APIError) as e:
            parse(body, "m", LIMITS)
        assert (e.value.status, e.value.param) == (400, param), e.value.message
        assert says in e.value.message


def test_top_k_equal_to_the_vocabulary_and_logit_bias_within_it_are_accepted():
    [req] = parse_completions({"prompt": "hi", "top_k": VOCAB, "logit_bias": {"3": -100, "7": 5.5}}, "m", LIMITS)
    assert req.sampling.top_k == VOCAB
    assert req.sampling.logit_bias == ((3, -100.0), (7, 5.5))


def test_logit_bias_moves_a_token_in_or_out_of_reach():
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 5.0
    pick = SamplingState.create(SamplingParams(temperature=0.0, logit_bias=((3, 100.0),)), [1, 2])
    ban = SamplingState.create(SamplingParams(temperature=0.0, logit_bias=((9, -100.0),)), [1, 2])
    none = SamplingState.create(SamplingParams(temperature=0.0), [1, 2])
    out = Sampler(VOCAB).sample(logits.expand(3, VOCAB).clone(), [pick, ban, none])
    assert out.token_ids[0] == 3 and out.token_ids[1] != 9 and out.token_ids[2] == 9


def test_a_transfer_failure_tells_the_client_its_cause_but_no_peer_room_or_address():
    from disagg_worker.engine.outbox import transfer_error

    reason = (
        "prefill instance 10.1.2.3:8998 (tiny-prefill-0.tiny-prefill:8998): room 4242 aborted by decode "
        "0123456789abcdef"
    )
    message = transfer_error("r1", "KV transfer failed", reason)
    assert message == (
        "KV transfer failed: prefill instance <address> (<address>): room <id> aborted by decode <id> "
        "(the server log has the details under request id r1)"
    )
