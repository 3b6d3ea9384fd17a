"""The prompt's own logprobs (completions' echo) from the engine: the same whether the prompt runs in one forward
or in chunks, batched with other requests or alone, with the prefix cache holding it or not, with overlap or
without; and the tokens the request samples are the ones it samples without asking."""

from __future__ import annotations

import pytest

from disagg_worker.engine.sampling import SamplingParams
from tests.unit.test_engine import make_engine, run_all, tokens_of, varied_prompts


def scored(outs) -> list[float]:
    first = next(o for o in outs if o.prompt_logprobs is not None)
    assert all(o.prompt_logprobs is None for o in outs if o is not first)  # sent once
    return first.prompt_logprobs


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_do_not_depend_on_chunks_batching_or_the_prefix_cache(tiny_model, overlap):
    prompts = varied_prompts(4)
    asked = SamplingParams(max_new_tokens=4, temperature=0, logprobs=2, prompt_logprobs=True)
    plain = SamplingParams(max_new_tokens=4, temperature=0)
    alone = make_engine(tiny_model, cache=False, chunk=0, overlap=False, max_running=1)
    expected = [run_all(alone, [(p, asked)], False)["0"] for p in prompts]
    engine = make_engine(tiny_model, chunk=8, overlap=overlap)
    # Each prompt twice (the second time its pages are in the prefix cache), beside requests that do not ask.
    requests = [(p, params) for p in prompts for params in (plain, asked, asked)]
    outs = run_all(engine, requests, overlap)
    for k, p in enumerate(prompts):
        want = scored(expected[k])
        assert len(want) == len(p) - 1
        first = next(o for o in expected[k] if o.prompt_logprobs is not None)
        assert all(len(t) == 2 for t in first.prompt_top_logprobs or [])
        for j in (3 * k + 1, 3 * k + 2):
            assert scored(outs[str(j)]) == pytest.approx(want, abs=1e-5)
            assert tokens_of(outs[str(j)]) == tokens_of(outs[str(3 * k)]) == tokens_of(expected[k])
        assert all(o.prompt_logprobs is None for o in outs[str(3 * k)])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_prompt_scoring_fails_fails_alone(tiny_model, overlap, monkeypatch):
    """Scoring runs inside the step's per-request boundary: the request whose scoring raises (a device out of
    memory, here forced) ends with a 500 naming it, and the others in its batch, scored or not, get what they get
    without it; every page is free afterwards (run_all checks)."""
    from disagg_worker.engine import prompt_logprobs

    doomed = [7] * 30
    real = prompt_logprobs.score

    def failing(req, start, rows):
        if req.prompt_ids == doomed:
            raise RuntimeError("out of memory (forced)")
        return real(req, start, rows)

    asked = SamplingParams(max_new_tokens=4, temperature=0, logprobs=2, prompt_logprobs=True)
    plain = SamplingParams(max_new_tokens=4, temperature=0)
    others = [(p, params) for p, params in zip(varied_prompts(3), (asked, plain, asked), strict=True)]
    expected = run_all(make_engine(tiny_model, chunk=64, overlap=overlap), others, overlap)
    monkeypatch.setattr(prompt_logprobs, "score", failing)
    outs = run_all(make_engine(tiny_model, chunk=64, overlap=overlap), [*others, (doomed, asked)], overlap)
    last = outs["3"][-1]
    assert last.error_status == 500 and last.error.endswith("under request id 3."), last
    assert "out of memory" not in last.error  # the exception stays in the log
    for rid in ("0", "1", "2"):
        assert not any(o.error for o in outs[rid])
        assert tokens_of(outs[rid]) == tokens_of(expected[rid])
    assert scored(outs["0"]) == pytest.approx(scored(expected["0"]), abs=1e-5)


def test_long_prompts_are_scored_in_blocks_as_in_one(tiny_model, monkeypatch):
    """Scores of a chunk longer than SCORE_ROWS are the same as when every row is scored at once."""
    from disagg_worker.engine import prompt_logprobs

    prompt = varied_prompts(12, seed=3)[4] * 3
    asked = SamplingParams(max_new_tokens=2, temperature=0, logprobs=3, prompt_logprobs=True)
    whole = scored(run_all(make_engine(tiny_model, chunk=0, overlap=False), [(prompt, asked)], False)["0"])
    monkeypatch.setattr(prompt_logprobs, "SCORE_ROWS", 7)
    blocks = scored(run_all(make_engine(tiny_model, chunk=0, overlap=False), [(prompt, asked)], False)["0"])
    assert len(blocks) == len(prompt) - 1 and blocks == pytest.approx(whole, abs=1e-6)
