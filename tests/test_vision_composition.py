"""Image requests composed with the engine's other features: tensor parallelism (TP=2: the decoder
sharded, the encoder replicated), int8 weights (the decoder's linear layers quantized, the encoder
kept in float), and warm-up (image steps run in the compiled buckets: nothing recompiles).

The reference is the float TP=1 engine, itself matched against transformers in `test_vision_engine`.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from serving import LLM, SamplingParams  # noqa: E402
from serving.core import model_runner  # noqa: E402
from test_vision_engine import ENGINE, NEW_TOKENS, TEXT, images, prompt  # noqa: E402
from test_vision_qwen2_5_vl import build_converted  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The checkpoint, its prompts (two images and a text-only one) and the TP=1 float engine's greedy tokens."""
    out_dir = build_converted(tmp_path_factory, "qwen2_5_vl_composition")[4]
    a, b, c = images()
    prompts = [prompt(a), prompt(c), TEXT + [9, 80, 120]]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = LLM(out_dir, **ENGINE).generate(prompts, sp)
    return out_dir, prompts, sp, outs


def _prompt_logprobs(out):
    ids = out.prompt_token_ids
    return np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])])


def test_tp2_identical_to_tp1(reference):
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, tensor_parallel_size=2, **ENGINE)
    assert len(llm.engine.runner.params.layers[0].wq.sharding.device_set) == 2
    got = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(_prompt_logprobs(g), _prompt_logprobs(w), atol=1e-4)


def test_int8_weights(reference):
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, weight_dtype="int8", **ENGINE)
    assert llm.config.weight_dtype == "int8"
    assert llm.engine.runner.params.vision.blocks[0].qkv.dtype == np.float32  # the encoder stays float
    got = llm.generate(prompts, sp)
    diffs = np.concatenate([np.abs(_prompt_logprobs(g) - _prompt_logprobs(w)) for g, w in zip(got, want)])
    # Per-channel int8 moves a prompt logprob by hundredths, not by the units a misplaced image would.
    assert 0 < diffs.mean() < 0.2
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in got)


def test_nothing_recompiles_after_warm_up(reference):
    out_dir, prompts, sp, want = reference
    llm = LLM(out_dir, warmup=True, **ENGINE)
    before = model_runner.compilation_count()
    got = llm.generate(prompts, sp)
    assert model_runner.compilation_count() == before
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
