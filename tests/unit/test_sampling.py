"""Sampler and StopChecker: the tokens and text a user gets for given sampling parameters."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.engine.sampling import (
    SampleOutput,
    Sampler,
    SamplingParams,
    SamplingState,
    StopChecker,
)

VOCAB = 50


def state(prompt=(1, 2, 3), output=(), **kw) -> SamplingState:
    s = SamplingState.create(SamplingParams(**kw), list(prompt))
    s.output_ids.extend(output)
    return s


def logits(batch: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=g) * scale


def draw_counts(row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Token histogram of n draws from `row`, one batch of n identical requests."""
    sampler = Sampler(VOCAB, seed=123)
    out = sampler.sample(row.expand(n, VOCAB).clone(), [state(**kw) for _ in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB)


def test_greedy_is_argmax_and_ignores_filters():
    x = logits(8)
    reqs = [state(temperature=0.0, top_p=0.3, top_k=5) for _ in range(8)]
    out = Sampler(VOCAB).sample(x, reqs)
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_logits_wider_than_vocab_never_yield_padding_tokens():
    x = torch.zeros(4, VOCAB + 14)
    x[:, VOCAB:] = 100.0
    out = Sampler(VOCAB).sample(x, [state(), state(), state(temperature=0.0), state(top_k=3)])
    assert all(t < VOCAB for t in out.token_ids)


@pytest.mark.parametrize("temperature", [0.1, 1.0, 2.0])
def test_top_k_one_equals_greedy(temperature):
    x = logits(16, seed=1, scale=0.5)
    out = Sampler(VOCAB).sample(x, [state(temperature=temperature, top_k=1) for _ in range(16)])
    assert out.token_ids == x.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    x = logits(16, seed=2, scale=0.5)
    out = Sampler(VOCAB).sample(x, [state(temperature=1.5, top_p=1e-6) for _ in range(16)])
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)))
    counts = draw_counts(row, 3000, top_p=0.7)
    assert counts[0] > 0 and counts[1] > 0
    assert counts[2:].sum() == 0
    # Renormalised over the kept set: 0.5 / 0.8 and 0.3 / 0.8.
    assert abs(counts[0].item() / 3000 - 0.625) < 0.05


def test_top_k_restricts_to_the_k_best():
    row = torch.linspace(0.0, 1.0, VOCAB)
    counts = draw_counts(row, 2000, top_k=3)
    assert set(counts.nonzero().squeeze(1).tolist()) == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_beyond_the_candidate_window_falls_back_to_the_whole_vocabulary(monkeypatch):
    monkeypatch.setattr("disagg_worker.engine.sampling.TOP_P_CANDIDATES", 4)
    row = torch.zeros(VOCAB)  # uniform: top_p=0.49 keeps 25 tokens, far beyond 4 candidates
    counts = draw_counts(row, 4000, top_p=0.49)
    assert int((counts > 0).sum()) == 25


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4)) + 1e-12
    counts = draw_counts(probs.log(), 3000, min_p=0.6)
    assert counts[0] > 0 and counts[1] > 0
    assert counts[2:].sum() == 0


def test_seeded_sampling_does_not_depend_on_batch_mates():
    x = logits(1, seed=3, scale=0.3)
    mates_a = [state(temperature=0.0), state(top_p=0.5), state(seed=99, top_k=4)]
    mates_b = [state(temperature=1.7, min_p=0.1), state()]

    def run(mates, steps=6):
        sampler, me = Sampler(VOCAB, seed=len(mates)), state(seed=7, temperature=1.0)
        batch = [*mates[:1], me, *mates[1:]]
        for step in range(steps):
            out = sampler.sample(logits(len(batch), seed=step).index_copy(0, torch.tensor([1]), x), batch)
            for r, t in zip(batch, out.token_ids, strict=True):
                r.output_ids.append(t)
        return me.output_ids

    first = run(mates_a)
    assert first == run(mates_b)
    assert len(set(first)) > 1  # really sampled, not a constant


def test_a_seeded_request_resumed_on_another_instance_draws_what_it_would_have():
    """Prefill samples token 0; decode starts a fresh generator from the same seed and skips that draw."""
    x = logits(1, seed=4, scale=0.3)

    def tokens(s: SamplingState, steps: int) -> list[int]:
        sampler = Sampler(VOCAB)
        for _ in range(steps):
            s.output_ids.append(sampler.sample(x, [s]).token_ids[0])
        return s.output_ids

    one_instance = tokens(state(seed=11, temperature=1.0), 6)
    resumed = state(seed=11, temperature=1.0)
    resumed.draws_elsewhere = 1
    assert tokens(resumed, 5) == one_instance[1:]
    assert tokens(state(seed=11, temperature=1.0), 5) != one_instance[1:]  # what decode drew before


def test_different_seeds_give_different_samples():
    x = logits(1, scale=0.1).expand(2, VOCAB)
    a, b = state(seed=1), state(seed=2)
    sampler = Sampler(VOCAB)
    tokens = [tuple(sampler.sample(x, [a, b]).token_ids) for _ in range(8)]
    assert any(t[0] != t[1] for t in tokens)


def test_unseeded_sampling_matches_softmax():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (VOCAB - 5))
    n = 6000
    for temperature in (1.0, 0.5):
        counts = draw_counts(row, n, temperature=temperature)
        expected = torch.softmax(row / temperature, -1) * n
        keep = expected > 5
        chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()
        assert counts[~keep].sum() == 0
        # 4 degrees of freedom: P(chi2 > 25) < 1e-4.
        assert chi2 < 25, (temperature, counts[:5].tolist(), expected[:5].tolist())


def test_repetition_penalty_lowers_repeated_tokens_both_signs():
    x = torch.zeros(1, VOCAB)
    x[0, 5], x[0, 6], x[0, 7] = 2.0, 1.9, -1.0
    assert Sampler(VOCAB).sample(x, [state(temperature=0.0)]).token_ids == [5]
    out = Sampler(VOCAB).sample(x, [state(prompt=[5], temperature=0.0, repetition_penalty=1.2)])
    assert out.token_ids == [6]  # 2.0 / 1.2 < 1.9
    x2 = torch.full((1, VOCAB), -5.0)
    x2[0, 7], x2[0, 8] = -1.0, -1.1
    out = Sampler(VOCAB).sample(x2, [state(output=[7], temperature=0.0, repetition_penalty=1.2)])
    assert out.token_ids == [8]  # -1.0 * 1.2 < -1.1


def test_frequency_penalty_grows_with_count_and_presence_does_not():
    row = torch.zeros(VOCAB)
    row[0] = 1.0
    base = draw_counts(row, 3000)[0]
    once = draw_counts(row, 3000, output=[0], frequency_penalty=0.5)[0]
    thrice = draw_counts(row, 3000, output=[0, 0, 0], frequency_penalty=0.5)[0]
    assert base > once > thrice
    pres1 = draw_counts(row, 3000, output=[0], presence_penalty=1.0)[0]
    pres3 = draw_counts(row, 3000, output=[0, 0, 0], presence_penalty=1.0)[0]
    assert pres1 < base and abs(int(pres1) - int(pres3)) < 60


def test_negative_frequency_penalty_encourages_repeats():
    x = torch.zeros(1, VOCAB)
    x[0, 3] = 0.5
    out = Sampler(VOCAB).sample(x, [state(output=[9, 9], temperature=0.0, frequency_penalty=-1.0)])
    assert out.token_ids == [9]


def test_penalties_only_touch_their_own_row():
    x = logits(2, seed=4)
    top = x[1].argmax().item()
    reqs = [state(output=[top] * 5, frequency_penalty=2.0, temperature=0.0), state(temperature=0.0)]
    assert Sampler(VOCAB).sample(x, reqs).token_ids[1] == top


def test_logprobs_are_raw_sorted_and_consistent_with_softmax():
    x = logits(3, seed=5)
    reqs = [
        state(logprobs=5, temperature=0.0, repetition_penalty=2.0, output=[1, 2]),
        state(logprobs=0),
        state(),
    ]
    out: SampleOutput = Sampler(VOCAB).sample(x, reqs)
    ref = torch.log_softmax(x, -1)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in pairwise(top))
    assert all(math.isclose(lp, ref[0, t].item(), abs_tol=1e-5) for t, lp in top)
    for i in range(3):
        assert math.isclose(out.logprobs[i], ref[i, out.token_ids[i]].item(), abs_tol=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"min_new_tokens": 20, "max_new_tokens": 10}, "min_new_tokens"),
    ],
)
def test_validate_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kw).validate()


def test_validate_accepts_defaults_and_edges():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, seed=-1, logprobs=20).validate()


def test_stop_split_across_deltas():
    c = StopChecker(("STOP",))
    assert c.push("hello S") == ("hello ", False)
    assert c.push("TO") == ("", False)
    assert c.push("P and more") == ("", True)
    assert c.push("later") == ("", True)
    assert c.flush() == ""


def test_partial_prefix_is_released_when_it_turns_out_not_to_stop():
    c = StopChecker(("</s>",))
    assert c.push("a </") == ("a ", False)
    assert c.push("b") == ("</b", False)
    assert c.push("x <") == ("x ", False)
    assert c.flush() == "<"


def test_the_stop_that_completes_first_wins_however_the_text_is_split():
    assert StopChecker(("world", "lo w")).push("hello world") == ("hel", True)
    assert StopChecker(("a", "baa")).push("baa") == ("b", True)
    split = StopChecker(("a", "baa"))
    assert split.push("b") == ("", False)
    assert split.push("aa") == ("b", True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_emitted_text_is_the_text_before_the_stop_that_completes_first(text, stops, cuts):
    pieces, last = [], 0
    for c in sorted(cuts) + [len(text)]:
        pieces.append(text[last:c])
        last = max(last, c)
    checker, emitted, hit = StopChecker(tuple(stops)), "", False
    for p in pieces:
        out, hit = checker.push(p)
        emitted += out
    emitted += checker.flush()
    # The stop that completes first wins (earliest end, then earliest start).
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert emitted == (text[: min(found)[1]] if found else text)
    assert hit == bool(found)
