"""Pages a sliding window has passed are released: a windowed model's long generations fit a pool
that holds only their windows, and every token is what the engine gives when it keeps every page."""

from __future__ import annotations

import jax
import pytest

from conftest import tiny_config
from model.params import init_params
from serving import LLM, SamplingParams

CFG = tiny_config(architecture="MistralForCausalLM", sliding_window=8)
# 3 sequences of 12 + 40 tokens need 13 pages of 4 each with every page kept (39 > 24); with the window
# released each holds about 8 / 4 + 2.
ENGINE = dict(page_size=4, num_pages=24, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, min_context_bucket=64)
PROMPTS = [[1] + [(7 * i + 3 * j) % 90 + 3 for j in range(11)] for i in range(3)]


def _run(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    forked = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2))
    tokens = [list(o.outputs[0].token_ids) for o in outs] + [list(c.token_ids) for c in forked[0].outputs]
    llm.engine.block_manager.check_invariants([])
    assert llm.engine.block_manager.num_free_blocks == ENGINE["num_pages"]  # nothing leaked
    return tokens, llm.engine.stats()


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(7))


def test_released_pages_change_no_token_and_spare_preemptions(params, monkeypatch):
    windowed = LLM(config=CFG, params=params, **ENGINE)
    assert windowed.engine.block_manager.window == 8
    tokens, stats = _run(windowed)
    released = windowed.engine.block_manager.num_released_pages

    monkeypatch.setattr("serving.core.engine.releasing_window", lambda cfg: None)
    keeping = LLM(config=CFG, params=params, **ENGINE)
    assert keeping.engine.block_manager.window is None
    want, keep_stats = _run(keeping)

    assert tokens == want
    assert tokens[3] == tokens[4] == tokens[0]  # the fork's samples share the released prefix
    assert released > 3 * 8  # each sequence let go of most of its 13 pages
    assert stats.num_preemptions == 0 < keep_stats.num_preemptions
