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
