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


# --- speculative decoding and KV transfer under tensor parallelism ---------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_is_identical_at_tp_1_and_2(params, single_device_tokens, method):
    """Greedy speculation verifies drafts to the tokens plain decoding gives, on one device and on two."""
    # The target itself as the draft model: its drafts are mostly right, so verification really accepts.
    spec = dict(speculative_method=method, num_speculative_tokens=3,
                speculative_draft=(CFG, params) if method == "draft" else None)
    batch = prompts(CFG.vocab_size)
    got = {}
    for tp in (1, 2):
        llm = LLM(config=CFG, params=params, tensor_parallel_size=tp, **spec, **COMMON)
        got[tp] = greedy(llm, batch)
        stats = llm.engine.stats().spec_decode
        assert stats.num_draft_tokens > 0  # drafts were verified (prompt lookup on random prompts accepts few)
        if method == "draft":
            assert stats.num_accepted_tokens > 0
        if tp == 2:
            assert len(llm.engine.runner.params.layers[0].wq.sharding.device_set) == 2
    assert got[1] == got[2] == single_device_tokens


def test_kv_export_and_import_are_identical_at_tp_1_and_2(params, single_device_tokens):
    """Prefill on one engine, ship the signed payload, decode on another: every pairing of TP=1 and TP=2
    gives the tokens one device gives alone, and the sharded pool keeps its shardings."""
    from conftest import run_to_completion
    from serving import SamplingParams
    from serving.disaggregation import kv_transfer as kt
    from serving.disaggregation import kv_wire

    keys = kv_wire.SigningKeys("test secret")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    def engine(tp):
        return LLM(config=CFG, params=params, tensor_parallel_size=tp, **COMMON).engine

    prefill, decode = {tp: engine(tp) for tp in (1, 2)}, {tp: engine(tp) for tp in (1, 2)}
    batch = prompts(CFG.vocab_size)
    for src, dst in ((2, 2), (1, 2), (2, 1)):
        pre, dec = prefill[src], decode[dst]
        shardings = [x.sharding for x in dec.runner.cache.k]
        for i, p in enumerate(batch):
            exports = []
            req = pre.make_request(f"pre{src}{dst}-{i}", p, first, part_args={"kv_export": kt.Exporter(exports.append)})
            pre.enqueue(req)
            run_to_completion(pre)
            payload = kt.encode_payload(exports[0], pre.cfg, pre.runner.kv_dtype, keys)
            header, body = kt.decode_payload(payload, keys, dec.cfg, dec.runner.kv_dtype, dec.max_model_len)
            imp = kt.to_import(header, body, dec.cfg, dec.runner.kv_dtype)
            req = dec.make_request(f"dec{src}{dst}-{i}", p, sp, part_args={"kv_import": imp})
            dec.enqueue(req)
        outs = run_to_completion(dec)
        got = [list(outs[f"dec{src}{dst}-{i}"].outputs[0].token_ids) for i in range(len(batch))]
        assert got == single_device_tokens, (src, dst)
        assert [x.sharding for x in dec.runner.cache.k] == shardings
        assert dec.block_manager.num_used_blocks == 0 and pre.block_manager.num_used_blocks == 0
