"""Decode-sized token buckets at multiples of `decode_bucket_step` (`Buckets.token_sizes`).

With powers of two alone, 17 running sequences decode in a 32-row step; with multiples of 8 between 8
and `max_num_seqs`, in a 24-row one. The bucket arithmetic is checked on its own; one small engine
checks that the finer buckets are compiled by the full warm-up (nothing compiles after it), that decode
steps land in them, and that greedy tokens are those of the powers-of-two engine.
"""

import random

import jax
import pytest

from serving import LLM, SamplingParams
from serving.core import engine_args
from serving.core.bucket_plan import expected_shapes, holds_cheaply
from serving.core.input_batch import Buckets, StepShape
from conftest import assert_same_logprobs, tiny_config

DEFAULT_STEP = engine_args.BY_NAME["decode_bucket_step"].default


def test_the_default_step_is_multiples_of_eight_up_to_max_num_seqs():
    assert DEFAULT_STEP == 8
    b = Buckets(512, 64, 128, decode_step=DEFAULT_STEP)
    assert b.token_sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512]
    # Off: the powers of two alone, as before.
    assert Buckets(512, 64, 128, decode_step=0).token_sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    # A finer step; the multiples stop at max_num_seqs (the prefill-sized buckets stay powers of two).
    assert Buckets(256, 20, 8, decode_step=4).token_sizes == [1, 2, 4, 8, 12, 16, 20, 32, 64, 128, 256]
    # min_tokens is still the smallest bucket: multiples start at the first one at or above it.
    assert Buckets(512, 64, 128, min_tokens=12, decode_step=8).token_sizes[:3] == [12, 16, 24]
    assert Buckets(512, 64, 128, min_tokens=16, decode_step=8).token_sizes[:3] == [16, 24, 32]
    with pytest.raises(ValueError, match="decode_bucket_step"):
        Buckets(512, 64, 128, decode_step=-8)


def test_a_decode_pads_to_the_next_multiple_and_keeps_the_bucket_invariants():
    b = Buckets(512, 64, 128, min_pages=4, decode_step=8)
    pow2 = Buckets(512, 64, 128, min_pages=4, decode_step=0)
    assert [b.tokens_for(n) for n in (1, 3, 8, 9, 12, 17, 24, 26, 33, 57, 64, 65, 300)] == \
        [1, 4, 8, 16, 16, 24, 24, 32, 40, 64, 64, 128, 512]
    assert [pow2.tokens_for(n) for n in (17, 26, 33)] == [32, 32, 64]
    # S is tied to T; every decode-sized bucket of 16 rows or more has the one (largest) page bucket.
    assert [b.seqs_for(t) for t in (24, 40, 128)] == [24, 40, 64]
    assert b.step_pages(24, 3) == b.step_pages(56, 3) == 128 and b.step_pages(8, 3) == 4
    shapes = b.all_shapes()
    assert [(t, s, p) for t, s, p in shapes if t in (24, 40, 48, 56)] == \
        [(24, 24, 128), (40, 40, 128), (48, 48, 128), (56, 56, 128)]
    assert len(shapes) == len(pow2.all_shapes()) + 4  # one program per added bucket
    assert all((t, s, b.step_pages(t, 3)) in shapes for t, s, _ in shapes)


def test_the_planner_expects_the_decode_in_its_own_finer_bucket():
    """20 requests decode in the 24-row bucket; a step of fewer rows pads into it cheaply, and the prefill
    bucket is unchanged."""
    b = Buckets(512, 32, 32, decode_step=8)
    rng = random.Random(0)
    requests = [(rng.randint(16, 256), rng.randint(16, 256), 1) for _ in range(20)]
    assert expected_shapes(b, 16, requests) == [StepShape(512, 32, 32), StepShape(24, 24, 32)]
    assert expected_shapes(Buckets(512, 32, 32), 16, requests)[1] == StepShape(32, 32, 32)
    decode24 = StepShape(24, 24, 32)
    assert holds_cheaply(decode24, StepShape(16, 16, 32), b) and holds_cheaply(decode24, StepShape(1, 1, 2), b)
    assert not holds_cheaply(decode24, StepShape(32, 32, 32), b)  # smaller: never


# Few programs: token buckets 8, 16, (24,) 32, one page bucket.
ENGINE = dict(max_num_seqs=24, max_num_batched_tokens=32, min_token_bucket=8, page_size=8, max_model_len=64,
              min_context_bucket=64, num_pages=211, attention_backend="reference", compilation_cache_dir="",
              enable_prefix_caching=False)


def test_decodes_run_in_the_finer_bucket_after_a_full_warm_up_with_the_same_greedy_tokens():
    """20 sequences decode in the 24-row bucket (the powers-of-two engine's in 32), the full warm-up compiled
    it (no compile after warm-up) and the greedy tokens and logprobs are the same."""
    from model.params import init_params

    cfg = tiny_config()
    weights = init_params(cfg, jax.random.key(7))
    rng = random.Random(3)
    # Outputs longer than the prefill phase (~4 steps of the 32-token budget), so that 17-20 sequences decode
    # together for a while.
    prompts = [[1] + [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(1, 5))] for _ in range(20)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(14, 20), ignore_eos=True, logprobs=1)
              for _ in prompts]

    def run(llm):
        llm.engine.stats_log.drain()
        outs = llm.generate(prompts, params)
        decode_buckets = {s.bucket[0] for s in llm.engine.stats_log.drain() if s.num_tokens == s.num_seqs > 16}
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], decode_buckets

    pow2 = LLM(config=cfg, params=weights, decode_bucket_step=0, warmup=False, **ENGINE)
    exact_tokens, exact_logprobs, pow2_buckets = run(pow2)
    assert pow2_buckets == {32}

    llm = LLM(config=cfg, params=weights, decode_bucket_step=8, warmup=True, **ENGINE)
    try:
        runner = llm.engine.runner
        assert runner.buckets.token_sizes == [8, 16, 24, 32]
        tokens, logprobs, buckets = run(llm)
        assert buckets == {24}
        assert runner.warmup_stats().compiles_after_ready == 0
        assert tokens == exact_tokens
        assert_same_logprobs(logprobs, exact_logprobs, 1e-5)
    finally:
        llm.shutdown()
        pow2.shutdown()
