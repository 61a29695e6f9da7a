"""The per-step shape the engine records (`IterationStats.bucket`, `q_lens`, `kv_lens`) and the
accounting `benchmarks/step_breakdown.py` does with it."""

import os
import sys

import jax
import pytest

from conftest import tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from serving.core.stats import IterationStats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from step_breakdown import ModelCosts, attention_positions, breakdown, kind_of, visible_pairs  # noqa: E402

CFG = tiny_config()
PAGE = 8


def _step(q_lens, kv_lens, bucket, seconds=1.0, generated=None):
    it = IterationStats(0, sum(q_lens), len(q_lens), 0, len(q_lens) if generated is None else generated, 0,
                        0.1 * seconds, 0.9 * seconds, 0)
    it.bucket, it.q_lens, it.kv_lens = bucket, tuple(q_lens), tuple(kv_lens)
    return it


def test_the_engine_records_each_steps_bucket_and_sequences():
    # One bucket (8 tokens, 4 rows, 8 pages): a single compile.
    llm = LLM(config=CFG, params=init_params(CFG, jax.random.key(0)), max_num_seqs=4, max_num_batched_tokens=8,
              page_size=PAGE, max_model_len=64, num_pages=32, min_token_bucket=8, attention_backend="reference",
              async_scheduling=False)
    prompts = [[1] + list(range(5, 5 + n)) for n in (19, 3)]  # 20 and 4 tokens
    llm.engine.stats_log.drain()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    steps = [s for s in llm.engine.stats_log.drain() if s.num_tokens]
    assert steps[0].q_lens == (8,) and steps[0].kv_lens == (8,)  # the long prompt's first chunk fills the budget
    assert {s.bucket for s in steps} == {(8, 4, 8)}
    for s in steps:
        T, S, P = s.bucket
        assert sum(s.q_lens) == s.num_tokens <= T and len(s.q_lens) == s.num_seqs <= S
        assert all(kv <= P * PAGE for kv in s.kv_lens)
    # The short prompt's sequence: prefilled whole (4 tokens), then one position more per decode step.
    short = [s.kv_lens[-1] for s in steps if len(s.kv_lens) == 2]
    assert short[0] == 4 and short == list(range(4, 4 + len(short)))


def test_kinds_and_the_positions_attention_computes():
    assert kind_of((1, 1, 1), (4, 4, 2)) == "decode x4"
    assert kind_of((5, 1), (8, 4, 2)) == "mixed" and kind_of((5, 3), (8, 4, 2)) == "prefill"
    assert visible_pairs(1, 10) == 10 and visible_pairs(3, 3) == 6  # causal: 1 + 2 + 3
    one_row = lambda T, S: 1  # noqa: E731
    # One-row items read their live pages: contexts 9 and 16 are 2 pages each.
    assert attention_positions((1, 1), (9, 16), (2, 2, 4), PAGE, one_row) == 2 * (2 * PAGE)
    # ... or their live pages 3 at a time (the last block masked past the row's last page): 2 pages -> 3.
    assert attention_positions((1, 1), (9, 16), (2, 2, 4), PAGE, one_row, pair_pages=3) == 2 * (3 * PAGE)
    # Items of 4 rows gather the whole 4-page table: 6 rows are 2 items.
    assert attention_positions((6,), (6,), (8, 2, 4), PAGE, lambda T, S: 4) == 2 * 4 * 4 * PAGE
    # ... or their table a block of pages at a time, up to the block of their last row's key: rows 0-3
    # see keys < 4 and rows 4-5 keys < 6, one 1-page block each.
    assert attention_positions((6,), (6,), (8, 2, 4), PAGE, lambda T, S: 4, item_block_pages=1) == 2 * 4 * PAGE
    # 12 rows over a context of 20 (positions 8-19): keys < 12, < 16 and < 20 -> 2, 2 and 3 pages.
    assert attention_positions((12,), (20,), (16, 2, 4), PAGE, lambda T, S: 4, item_block_pages=1) == 4 * 7 * PAGE
    # The decode of a mixed step is a one-row item: 3 pages at position 19, whatever the item size.
    assert attention_positions((6, 1), (6, 20), (8, 2, 4), PAGE, lambda T, S: 4) == 2 * 4 * 4 * PAGE + 3 * PAGE


def test_breakdown_accounts_padding_roofs_and_the_tail():
    costs = ModelCosts(matmul_params=1000, head_params=100, weight_bytes=100_000, kv_bytes_per_position=10,
                       attention_flops_per_pair=4)
    steps = [_step((6,), (6,), (8, 2, 1), seconds=2.0, generated=1),
             _step((1, 1, 1), (7, 8, 9), (4, 4, 2), seconds=1.0)]
    table = breakdown(steps, costs, page_size=PAGE, matmul_rate=1e6, read_bw=1e7,
                      rows_per_item=lambda T, S: 1 if T <= S else 4, tail_seqs=1)
    prefill, decode = table["kinds"]["prefill"], table["kinds"]["decode x4"]
    assert prefill["padded_token_share"] == pytest.approx(0.25) and decode["padded_token_share"] == pytest.approx(0.25)
    # prefill: useful 2*1000*6 + 2*100*1 + 4*21 FLOPs = 12284 at 1e6/s > 100060 bytes at 1e7/s: compute-bound.
    assert prefill["roof_seconds"] == pytest.approx(12284e-6) and prefill["bound"] == "compute"
    assert prefill["roof_fraction"] == pytest.approx(12284e-6 / 2.0)
    # decode: 3 rows over contexts 7, 8, 9 -> 24 live pairs of 1 + 1 + 2 pages computed (32 positions).
    assert decode["padded_kv_share"] == pytest.approx(1 - 24 / 32)
    # decode: 2*1000*3 + 2*100*3 + 4*24 = 6696 FLOPs (6.7 ms) < 100240 bytes (10.0 ms): memory-bound.
    assert decode["bound"] == "memory" and decode["roof_seconds"] == pytest.approx((100_000 + 240) / 1e7)
    assert decode["host_seconds"] == pytest.approx(0.1) and table["tail"]["steps"] == 1  # the one-sequence step
    assert table["total"]["seconds"] == pytest.approx(3.0) and prefill["share_of_wall"] == pytest.approx(2 / 3)


def test_products_alone_of_a_schedule_with_xla_and_with_torch():
    """`products_ceiling`: each bucket's products timed once per library, summed over the steps; the torch
    chain (a transformers model's own modules on the same weights) gives the XLA chain's tokens."""
    from offline_throughput import hf_model_from
    from products_ceiling import products, schedule_products

    params = init_params(CFG, jax.random.key(1))
    tokens = jax.numpy.array([5, 9], jax.numpy.int32)
    alone = products(params, tokens, CFG.rms_norm_eps).tolist()
    assert products(params, tokens, CFG.rms_norm_eps, head_rows=4).tolist() == alone + [alone[-1]] * 2
    steps = [_step((1, 1), (3, 4), (2, 2, 1)), _step((1, 1), (4, 5), (2, 2, 1)), _step((6,), (6,), (8, 2, 1))]
    idle = _step((), (), (2, 2, 1))
    idle.bucket = None
    out = schedule_products(steps + [idle], params, CFG.rms_norm_eps, hf_model_from(CFG, params), rounds=2)
    assert [(b["tokens"], b["rows"], b["steps"]) for b in out["buckets"]] == [(2, 2, 2), (8, 2, 1)]
    for lib in ("xla", "torch"):
        assert out[f"{lib}_seconds"] == pytest.approx(sum(b["steps"] * b[f"{lib}_ms"] for b in out["buckets"]) / 1e3)
