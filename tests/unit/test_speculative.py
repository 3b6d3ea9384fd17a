"""Speculative decoding with n-gram drafts, in-process on the tiny model: the answers a user gets are the same
tokens (greedy, seeded sampling with penalties and top-p, logprobs, a JSON grammar, stop tokens, max_tokens),
produced in fewer steps, and every page comes back."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_worker.config import (
    CacheConfig,
    ConfigError,
    DisaggConfig,
    EngineConfig,
    Role,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.engine.speculative import (
    ACCEPTED,
    DRAFTED,
    MODEL_RULE,
    NGRAM_RULE,
    DraftPlanner,
    propose_ngram,
)
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg
from tests.unit.test_engine import assert_idle_accounting

NGRAM = SpeculativeConfig(algorithm="NGRAM", num_draft_tokens=4, min_match=2, max_match=6)


def naive_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, written the slow way: longest suffix first, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_longest_suffix_seen_before_proposes_what_followed_it_last_time():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 4) == [7, 5, 1]
    assert propose_ngram([5, 6, 7, 8, 6, 7], 4, 2, 4) == [8, 6, 7]
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []  # nothing repeats
    assert propose_ngram([4, 4], 2, 2, 3) == []  # too short for a 2-token match before the suffix
    # Token ids whose bytes line up across token boundaries are not matches.
    assert propose_ngram([256, 1, 0, 1], 2, 1, 1) == [0, 1]
    assert propose_ngram([2**40, 3, 2**40], 1, 1, 2) == [3]


@given(
    tokens=st.lists(st.integers(0, 5), max_size=40),
    k=st.integers(1, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_proposals_follow_the_rule(tokens, k, min_n, extra):
    assert propose_ngram(tokens, k, min_n, min_n + extra) == naive_ngram(tokens, k, min_n, min_n + extra)


def test_a_draft_model_whose_drafts_keep_failing_pauses_longer_each_time_then_tries_again():
    drafter = DraftPlanner(SpeculativeConfig(algorithm="EAGLE", draft_model_path="head", num_steps=4))
    rule = MODEL_RULE
    assert drafter.rule is rule and drafter.propose("r", [1, 2], 9) == [0, 0]  # room for two draft tokens
    step = 0
    for pause in (rule.pause, 2 * rule.pause, 4 * rule.pause):
        for _ in range(rule.window):
            assert drafter.may_draft("r", step)
            drafter.record("r", 2, 0, step)  # every draft rejected
            step += 1
        paused_at = step - 1
        assert not drafter.may_draft("r", paused_at + 1)
        assert not drafter.may_draft("r", paused_at + pause - 1)
        assert drafter.may_draft("r", paused_at + pause)
        step = paused_at + pause
    assert drafter.propose("r", [1, 2], 9) == [0]  # one token: none of the last draft was kept
    for step in range(rule.window):  # half a token kept per drafted step: no pause
        drafter.record("s", 2, step % 2, step)
    assert drafter.may_draft("s", rule.window)
    for step in range(rule.window):  # a window that pays resets the doubling
        drafter.record("r", 1, 1, 10_000 + step)
    for step in range(rule.window):
        drafter.record("r", 1, 0, 20_000 + step)
    assert drafter.may_draft("r", 20_000 + rule.window - 1 + rule.pause)


def test_ngram_drafts_pause_when_they_keep_too_small_a_share():
    """An n-gram draft costs only its rows: a few misses in a row do not pause it; a kept share under a quarter
    of the rule's window of drafted tokens does, for the rule's pause."""
    drafter = DraftPlanner(NGRAM)
    rule = NGRAM_RULE
    assert drafter.rule is rule
    for step in range(4):
        drafter.record("r", 2, 0, step)  # 8 tokens drafted, none kept: too few to judge
    assert drafter.may_draft("r", 4)
    for step in range(rule.share_window // 8):
        drafter.record("s", 8, 1, step)
    paused_at = rule.share_window // 8 - 1
    assert not drafter.may_draft("s", paused_at + rule.pause - 1) and drafter.may_draft("s", paused_at + rule.pause)
    for step in range(rule.share_window // 4):  # a quarter kept: no pause
        drafter.record("t", 4, 1, step)
    assert drafter.may_draft("t", rule.share_window)


def test_draft_length_follows_what_the_drafts_achieve():
    drafter = DraftPlanner(NGRAM)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.propose("r", tokens, 9) == [3, 4, 5, 6]  # num_draft_tokens
    drafter.record("r", 4, 1, step=0)  # cut after one token: next at most two
    assert drafter.propose("r", tokens, 9) == [3, 4]
    drafter.record("r", 2, 2, step=1)  # kept whole: one more
    assert drafter.propose("r", tokens, 9) == [3, 4, 5]
    for step in range(3, 6):
        drafter.record("r", 3, 3, step)
    assert drafter.propose("r", tokens, 9) == [3, 4, 5, 6]  # never past num_draft_tokens
    assert drafter.propose("r", tokens, 2) == [3, 4]  # nor past the request's limit


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"algorithm": "MEDUSA"}, "--speculative-algorithm MEDUSA: one of NGRAM, EAGLE, STANDALONE"),
        ({"algorithm": "NGRAM", "num_draft_tokens": 0}, "--speculative-num-draft-tokens 0"),
        ({"algorithm": "NGRAM", "min_match": 3, "max_match": 2}, "--speculative-ngram-min-match-window-size 3"),
    ],
)
def test_settings_that_cannot_work_name_their_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        SpeculativeConfig(**kwargs)


def test_speculation_turns_overlap_off_where_drafts_are_made():
    def config(role: Role, spec: SpeculativeConfig) -> EngineConfig:
        return EngineConfig("m", scheduler=SchedulerConfig(speculative=spec), disagg=DisaggConfig(role=role))

    assert config(Role.MONOLITHIC, SpeculativeConfig()).overlap
    assert not config(Role.MONOLITHIC, NGRAM).overlap and not config(Role.DECODE, NGRAM).overlap
    assert config(Role.PREFILL, NGRAM).overlap and not config(Role.PREFILL, NGRAM).drafts


# ---- the engine -------------------------------------------------------------------------------------------


def engine(model: str, spec: bool, tokens: int = 8192, max_running: int = 64) -> Engine:
    cfg = EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=4, max_total_tokens=tokens),
        scheduler=SchedulerConfig(
            chunk_size=16, max_running_requests=max_running, speculative=NGRAM if spec else SpeculativeConfig()
        ),
    )
    return load_engine(cfg)


def run(e: Engine, requests: list[tuple[list[int], SamplingParams]], abort_after: dict[str, int] | None = None):
    """Every request's outputs, and the steps it took (overlap as the config says)."""
    stepper = Stepper(e)
    for i, (ids, params) in enumerate(requests):
        e.handle(msg.GenerateReq(str(i), ids, params))
    outs: dict[str, list[msg.TokenOut]] = {}
    steps = 0
    while stepper.busy:
        stepper.step()
        steps += 1
        assert steps < 10_000
        for o in e.take_outputs():
            outs.setdefault(o.rid, []).append(o)
        for rid, after in (abort_after or {}).items():
            if steps == after:
                e.handle(msg.AbortReq(rid))
    stepper.close()
    for o in e.take_outputs():
        outs.setdefault(o.rid, []).append(o)
    assert_idle_accounting(e)
    return outs, steps


def answer(outs: list[msg.TokenOut]) -> tuple:
    """What a client sees: tokens, logprobs, top logprobs, how it ended."""
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    tops = [t for o in outs for t in (o.top_logprobs or [])]
    return tokens, logprobs, tops, outs[-1].finish_reason


def assert_same_answer(got: list[msg.TokenOut], want: list[msg.TokenOut], params: SamplingParams) -> None:
    """Tokens and ending exactly; logprobs (when asked for) to float32 precision: a verified position's logits
    come from a multi-token forward, whose sums run in another order than a one-token step's."""
    tokens, logprobs, tops, finish = answer(got)
    assert (tokens, finish) == (answer(want)[0], answer(want)[3])
    if params.logprobs is None:
        return
    _, want_logprobs, want_tops, _ = answer(want)
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in want_tops]
    flat = [lp for top in tops for _, lp in top]
    assert flat == pytest.approx([lp for top in want_tops for _, lp in top], abs=1e-4)


def repetitive(seed: int) -> list[int]:
    rng = random.Random(seed)
    phrase = [rng.randrange(100, 2000) for _ in range(rng.choice([6, 11, 23]))]
    return (phrase * 4)[: rng.choice([20, 40, 70])] + [rng.randrange(100, 2000) for _ in range(3)]


FORMAT = json.dumps({"type": "json_object"})


def requests() -> list[tuple[list[int], SamplingParams]]:
    reqs = []
    for i in range(12):
        prompt = repetitive(i)
        params = [
            SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
            SamplingParams(max_new_tokens=33, temperature=0.9, seed=i, top_p=0.9, ignore_eos=True),
            SamplingParams(max_new_tokens=25, temperature=0.7, seed=i, repetition_penalty=1.2, frequency_penalty=0.3),
            SamplingParams(max_new_tokens=30, temperature=0.0, logprobs=3, ignore_eos=True),
        ][i % 4]
        reqs.append((prompt, params))
    reqs.append((repetitive(99), SamplingParams(max_new_tokens=30, temperature=0.8, seed=4, grammar=FORMAT)))
    return reqs


def test_answers_are_token_identical_with_fewer_steps_and_every_page_back(tiny_model):
    reqs = requests()
    plain, plain_steps = run(engine(tiny_model, spec=False), reqs)
    drafted, accepted = DRAFTED._value.get(), ACCEPTED._value.get()
    spec, spec_steps = run(engine(tiny_model, spec=True), reqs)
    accepted = ACCEPTED._value.get() - accepted
    assert DRAFTED._value.get() - drafted > accepted > 0, "no draft was ever kept: the test checked nothing"
    for i, (_, params) in enumerate(reqs):
        assert_same_answer(spec[str(i)], plain[str(i)], params)
    # max_tokens exactly, never one more from an accepted draft
    for i, (_, params) in enumerate(reqs):
        tokens, _, _, finish = answer(spec[str(i)])
        assert finish == "stop" or len(tokens) == params.max_new_tokens
    assert spec_steps < plain_steps


def test_a_stop_token_inside_an_accepted_draft_ends_the_answer_there(tiny_model):
    prompt = repetitive(3)
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    full = answer(run(engine(tiny_model, spec=False), [(prompt, greedy)])[0]["0"])[0]
    stop = full[len(full) // 2]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=(stop,))
    got, _, _, finish = answer(run(engine(tiny_model, spec=True), [(prompt, params)])[0]["0"])
    assert got == full[: full.index(stop) + 1] and finish == "stop"


def test_aborts_at_any_step_of_speculative_requests_free_every_page(tiny_model):
    rng = random.Random(7)
    reqs = [(repetitive(i), SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(40)]
    aborts = {str(i): rng.randrange(1, 60) for i in range(40) if i % 5}
    outs, _ = run(engine(tiny_model, spec=True, tokens=1024, max_running=8), reqs, abort_after=aborts)
    for i in range(40):
        finish = outs[str(i)][-1].finish_reason
        assert finish == ("length" if str(i) not in aborts else finish) and finish in ("abort", "length")


def test_drafts_take_only_what_every_running_request_leaves(tiny_model):
    """A batch budget of 6 tokens and 4 decoding requests: each still gets its step every time; drafts fill at
    most the 2 tokens left, and the answers stay the plain ones."""
    reqs = [(repetitive(i), SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)) for i in range(4)]

    def tight(spec: bool) -> Engine:
        sched = SchedulerConfig(chunk_size=16, max_batch_tokens=6, speculative=NGRAM if spec else SpeculativeConfig())
        return load_engine(
            EngineConfig(model_path=tiny_model, cache=CacheConfig(page_size=4, max_total_tokens=4096), scheduler=sched)
        )

    plain, _ = run(tight(False), reqs)
    e = tight(True)
    schedule, batches = e.scheduler.schedule, []

    def spy():
        running = [r for r in e.scheduler.running if r.todo == 1 and r.remaining_new_tokens() > 0]
        batch = schedule()
        if batch is not None:
            batches.append((len(running), batch))
        return batch

    e.scheduler.schedule = spy
    spec, _ = run(e, reqs)
    for i in range(len(reqs)):
        assert answer(spec[str(i)])[0] == answer(plain[str(i)])[0]
    decoding = [b for n, b in batches if n == 4 and b.forward.num_tokens > 4]
    assert decoding, "no step with four decoding requests drafted anything"
    for b in decoding:
        assert len(b.reqs) == 4 and b.forward.num_tokens <= 6
