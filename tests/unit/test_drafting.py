"""Speculative decoding with a draft model (EAGLE, STANDALONE), in-process on tiny models: the same answers as
without speculation (greedy, seeded with penalties and top-p, logprobs, a JSON grammar), every page back; a
draft that predicts well is kept (fewer steps); through P/D decode's first step drafts from what prefill handed
it; and the rejection step keeps the sampled distribution the target's."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg_worker.config import CacheConfig, ConfigError, DisaggConfig, EngineConfig, Role, SchedulerConfig
from disagg_worker.config import SpeculativeConfig as Spec
from disagg_worker.engine import drafting
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.sampling import Sampler, SamplingParams, SamplingState
from disagg_worker.engine.speculative import ACCEPTED, DRAFTED, verify
from disagg_worker.instance.loop import Stepper
from disagg_worker.model.eagle import make_eagle_head
from disagg_worker.model.tiny import make_tiny
from disagg_worker.request import messages as msg
from tests.unit.test_speculative import answer, assert_same_answer, requests, run

STEPS = 3  # page size 4: a step's drafts and its last known token fill one page


@pytest.fixture(scope="module")
def drafts(tiny_model, tmp_path_factory) -> dict[str, str]:
    """A random EAGLE head for the tiny model, and a one-layer tiny model with its tokenizer."""
    root = tmp_path_factory.mktemp("drafts")
    head = make_eagle_head(tiny_model, root / "eagle")
    small = make_tiny(root / "small", seed=3, overrides={"num_hidden_layers": 1})
    return {"eagle": str(head), "small": str(small)}


@pytest.fixture(scope="module")
def echo(tiny_model, tmp_path_factory) -> tuple[str, str]:
    """A target that repeats its last input token (its layers add nothing to the residual, its embedding rows
    have one norm, its LM head is the embedding), and an EAGLE head that predicts the token of the hidden
    state it reads (its fc passes the hidden state through, its layer adds nothing). Through P/D the head
    drafts the repeated token from its first step only with prefill's top-k and hidden state."""
    root = tmp_path_factory.mktemp("echo")
    target = Path(shutil.copytree(tiny_model, root / "target"))
    w = load_file(target / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()
        elif "norm" in name:
            w[name].fill_(1.0)
    embed = w["model.embed_tokens.weight"]
    embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
    w["lm_head.weight"] = embed.clone()
    save_file(w, str(target / "model.safetensors"))
    head = make_eagle_head(target, root / "head")
    h = load_file(head / "model.safetensors")
    size = embed.shape[1]
    h["fc.weight"] = torch.cat((torch.zeros(size, size), torch.eye(size)), dim=1)
    h["fc.bias"].zero_()
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        h[name].zero_()
    save_file(h, str(head / "model.safetensors"))
    return str(target), str(head)


def config(model: str, spec: Spec, role: Role = Role.MONOLITHIC, **sched: object) -> EngineConfig:
    disagg = DisaggConfig(role=role, transfer_backend="fake") if role is not Role.MONOLITHIC else DisaggConfig()
    return EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=4, max_total_tokens=8192),
        scheduler=SchedulerConfig(chunk_size=16, speculative=spec, **sched),  # type: ignore[arg-type]
        disagg=disagg,
    )


def eagle(path: str) -> Spec:
    return Spec(algorithm="EAGLE", draft_model_path=path, num_steps=STEPS)


def standalone(path: str) -> Spec:
    return Spec(algorithm="STANDALONE", draft_model_path=path, num_steps=STEPS)


@pytest.mark.parametrize("kind", ["eagle", "small", "itself"])
def test_answers_with_a_draft_model_are_the_plain_ones_and_every_page_comes_back(tiny_model, drafts, kind):
    reqs = requests()
    plain, plain_steps = run(load_engine(config(tiny_model, Spec())), reqs)
    spec = eagle(drafts["eagle"]) if kind == "eagle" else standalone(tiny_model if kind == "itself" else drafts[kind])
    drafted, accepted = DRAFTED._value.get(), ACCEPTED._value.get()
    got, steps = run(load_engine(config(tiny_model, spec)), reqs)
    assert DRAFTED._value.get() > drafted, "nothing was drafted: the test checked nothing"
    for i, (_, params) in enumerate(reqs):
        assert_same_answer(got[str(i)], plain[str(i)], params)
    if kind == "itself":  # the target drafting for itself: its greedy drafts are the greedy requests' tokens
        assert ACCEPTED._value.get() - accepted > 0.3 * (DRAFTED._value.get() - drafted)
        assert steps < plain_steps


def test_an_eagle_head_that_predicts_well_is_kept_from_the_first_step(echo):
    """The echo target repeats the prompt's last token; the head drafts the token of the hidden state it reads,
    which lags one position behind, so a prompt ending in a repeated token makes every draft right."""
    target, head = echo
    prompt = [5, 300, 41, 9, 77, 77]
    params = SamplingParams(max_new_tokens=2 + 4 * (STEPS + 1), temperature=0.0, ignore_eos=True)
    plain, _ = run(load_engine(config(target, Spec())), [(prompt, params)])
    assert answer(plain["0"])[0] == [77] * params.max_new_tokens
    drafted, accepted = DRAFTED._value.get(), ACCEPTED._value.get()
    got, steps = run(load_engine(config(target, eagle(head))), [(prompt, params)])
    assert answer(got["0"])[0] == [77] * params.max_new_tokens
    # Drafts of 2 tokens first, then STEPS: 1 + 3 + 4 + 4 + 4 + 2 tokens, every draft kept.
    assert ACCEPTED._value.get() - accepted == DRAFTED._value.get() - drafted == 2 + 3 * STEPS + 1
    assert steps <= 2 + 5  # the prompt's chunk, the first token's step, then five drafted steps


def test_a_prompt_found_in_the_prefix_cache_drafts_from_where_its_forward_starts(echo):
    """The second request's prompt extends the first's: its forward starts after the cached pages, and the head
    catches up from there (the draft KV of the cached pages is the first request's)."""
    target, head = echo
    first = [5, 300, 41, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 77, 77]
    second = first[:16] + [60, 61, 62, 63, 64, 65, 88, 88]
    params = SamplingParams(max_new_tokens=1 + 3 + 2 * (STEPS + 1), temperature=0.0, ignore_eos=True)
    e = load_engine(config(target, eagle(head)))
    stepper = Stepper(e)
    got = {}
    for rid, prompt in (("a", first), ("b", second)):
        e.handle(msg.GenerateReq(rid, prompt, params))
        accepted = ACCEPTED._value.get()
        while stepper.busy:
            stepper.step()
        got[rid] = ([t for o in e.take_outputs() for t in o.token_ids], ACCEPTED._value.get() - accepted)
    stepper.close()
    assert e.radix.stats.hit_tokens == 16  # four pages of the first prompt
    kept = 2 + 2 * STEPS  # drafts of 2, then of STEPS, all kept
    assert got == {"a": ([77] * params.max_new_tokens, kept), "b": ([88] * params.max_new_tokens, kept)}


ROOMS = itertools.count(5000)


def through_pd(target: str, spec: Spec, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """One request through prefill and decode engines over the fake transfer (it carries the aux record; the
    echo target needs no KV): decode's tokens, and the drafts it accepted."""
    p = load_engine(config(target, spec, Role.PREFILL))
    d = load_engine(config(target, spec, Role.DECODE))
    sp, sd = Stepper(p), Stepper(d)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    info = msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))
    p.handle(msg.GenerateReq("p", prompt, params, info))
    d.handle(msg.GenerateReq("d", prompt, params, info))
    accepted = ACCEPTED._value.get()
    out: list[int] = []
    for _ in range(1000):
        if not (sp.busy or sd.busy):
            break
        sp.step()
        sd.step()
        out += [t for o in d.take_outputs() for t in o.token_ids]
    sp.close(), sd.close(), p.close(), d.close()
    return out, int(ACCEPTED._value.get() - accepted)


def test_decode_drafts_its_first_step_from_what_prefill_handed_it(echo, monkeypatch):
    """Prefill runs the head over the prompt and sends its top-k and output hidden state; decode's first step
    drafts from them, never from the prompt (it has no hidden states of it): its two drafts (the top-k's, then
    the head's from the hidden state) are kept, and the answer is done. Received as zeros, the hidden state
    leaves the first step only the top-k's draft; received as nothing, none (the next step, drafting from the
    target's hidden states again, keeps the one draft max_tokens still allows): one kept draft either way."""
    target, head = echo
    prompt = [5, 300, 41, 9, 77]  # no repeated token at the end: a mono first step would draft 9
    tokens, accepted = through_pd(target, eagle(head), prompt, 4)
    assert tokens == [77] * 4 and accepted == 2

    real = drafting.received_draft

    def zero_hidden(n: int, data: bytes) -> drafting.DraftState:
        st = real(n, data)
        assert st.head is not None and st.head[1] is not None
        st.head = (st.head[0], torch.zeros_like(st.head[1]))
        return st

    monkeypatch.setattr("disagg_worker.engine.decode.received_draft", zero_hidden)
    assert through_pd(target, eagle(head), prompt, 4) == ([77] * 4, 1)
    monkeypatch.setattr("disagg_worker.engine.decode.received_draft", lambda n, data: real(n, b""))
    assert through_pd(target, eagle(head), prompt, 4) == ([77] * 4, 1)


def test_a_decode_with_a_draft_model_and_a_prefill_without_are_refused_by_name(tiny_model, drafts):
    from disagg_worker.disagg.mapping import draft_mismatch

    with_head = load_engine(config(tiny_model, eagle(drafts["eagle"]), Role.PREFILL))
    plain = load_engine(config(tiny_model, Spec(), Role.DECODE))
    try:
        theirs, ours = with_head.manager.layout.draft_kv, plain.manager.layout.draft_kv
        assert theirs.startswith("EAGLE (1 layer") and ours == ""
        assert "speculative decoding differs: prefill keeps draft KV EAGLE" in draft_mismatch(theirs, ours)
        assert with_head.kv_pool.num_layers == plain.kv_pool.num_layers + 1
    finally:
        with_head.close(), plain.close()


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"algorithm": "EAGLE"}, "--speculative-algorithm EAGLE needs --speculative-draft-model-path"),
        ({"algorithm": "STANDALONE", "draft_model_path": "x", "eagle_topk": 4}, "--speculative-eagle-topk 4"),
        ({"algorithm": "EAGLE", "draft_model_path": "x", "num_steps": 0}, "--speculative-num-steps 0"),
    ],
)
def test_draft_settings_that_cannot_work_name_their_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        Spec(**kwargs)


def test_a_draft_model_that_cannot_draft_for_the_model_stops_the_start_up(tiny_model, drafts, tmp_path):
    with pytest.raises(ConfigError, match="--tp-size 1 --pp-size 1"):
        EngineConfig(tiny_model, scheduler=SchedulerConfig(speculative=eagle("x")), disagg=DisaggConfig(tp_size=2))
    with pytest.raises(ConfigError, match="--speculative-num-steps 8: .* one page of --page-size 4"):
        config(tiny_model, Spec(algorithm="EAGLE", draft_model_path="x", num_steps=8))
    other_vocab = make_tiny(tmp_path / "v", overrides={"vocab_size": 1024, "num_hidden_layers": 1})
    with pytest.raises(ConfigError, match="--speculative-draft-model-path .*vocab_size 1024, the model's 2048"):
        load_engine(config(tiny_model, standalone(str(other_vocab))))
    with pytest.raises(ConfigError, match="is not an EAGLE head"):
        load_engine(config(tiny_model, eagle(drafts["small"])))
    wide = make_tiny(tmp_path / "w", overrides={"hidden_size": 64, "num_hidden_layers": 1})
    wide_head = make_eagle_head(wide, tmp_path / "wh")
    with pytest.raises(ConfigError, match="hidden_size 64, the model's 128"):
        load_engine(config(tiny_model, eagle(str(wide_head))))


# ---- the rejection step ---------------------------------------------------------------------------------------


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs`: the p-value."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def test_verified_drafts_keep_the_target_distribution():
    """A 5-token vocabulary, target distributions for two positions and a draft [1, 4]: over many seeded draws
    the first emitted token follows the target's first distribution, and the second (drawn where the first
    equals the draft's) the target's second (chi-square, p > 0.001). Keeping the draft's second token without
    checking it, as a verification without the rejection step would, fails the same test."""
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2] * 5]))
    sampler = Sampler(5)
    draft = [1, 4]
    runs = []
    for seed in range(4000):
        state = SamplingState.create(SamplingParams(temperature=1.0, seed=seed), [0], [])
        runs.append(verify(sampler, logits, [0], [state], [[]], [draft])[0].tokens)
    firsts = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=5)
    assert chi_square_p(firsts, torch.softmax(logits[0], -1)) > 1e-3
    # The draft's first token was the target's in about 40% of the draws: those drew a second token.
    seconds = [r[1] for r in runs if r[0] == draft[0]]
    assert all(len(r) == 1 for r in runs if r[0] != draft[0]) and len(seconds) > 1400
    assert chi_square_p(torch.bincount(torch.tensor(seconds), minlength=5), torch.softmax(logits[1], -1)) > 1e-3
    unchecked = torch.bincount(torch.tensor([draft[1]] * len(seconds)), minlength=5)
    assert chi_square_p(unchecked, torch.softmax(logits[1], -1)) < 1e-6
