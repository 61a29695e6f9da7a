"""Tensor parallelism through the engine: `LLM(tensor_parallel_size=N)`.

Greedy output of a mixed batch (prefills chunked by the budget, decodes,
ragged lengths) must be the same token for token at TP = 1, 2, 4 and 8, on a
random model whose KV heads are fewer than the widest TP degree (so they are
replicated there), and on the embedded checkpoint restored straight into the
TP shardings.
"""

import jax
import pytest

from conftest import greedy, ragged_prompts as prompts, tiny_config
from model.params import init_params
from serving import LLM

CFG = tiny_config(vocab_size=128, num_heads=8, num_kv_heads=2, head_dim=8)
COMMON = dict(page_size=8, max_model_len=64, num_pages=48, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, min_context_bucket=64, attention_backend="reference")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(7))


@pytest.fixture(scope="module")
def single_device_tokens(params):
    return greedy(LLM(config=CFG, params=params, **COMMON), prompts(CFG.vocab_size))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_greedy_tokens_identical_across_tp_degrees(params, single_device_tokens, tp):
    llm = LLM(config=CFG, params=params, tensor_parallel_size=tp, **COMMON)
    # The weights really are split: each device holds 1/tp of the query heads.
    wq = llm.engine.runner.params.layers[0].wq
    assert len(wq.sharding.device_set) == tp
    assert wq.addressable_shards[0].data.shape[0] == CFG.num_heads // tp  # [q_heads, head_dim, embed]
    assert greedy(llm, prompts(CFG.vocab_size)) == single_device_tokens


def test_embedded_checkpoint_restores_into_tp_shardings():
    batch = prompts(256, n=3, seed=1)
    want = greedy(LLM(**COMMON), batch)
    llm = LLM(tensor_parallel_size=2, **COMMON)
    assert len(llm.engine.runner.params.layers[0].w_up.sharding.device_set) == 2
    assert greedy(llm, batch) == want


def test_a_tp_degree_the_devices_cannot_hold_is_a_clear_error():
    with pytest.raises(Exception, match="16"):
        LLM(config=CFG, params=init_params(CFG, jax.random.key(0)), tensor_parallel_size=16, **COMMON)
