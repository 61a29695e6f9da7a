"""Prefill on one engine, ship the KV payload, decode on another: the same tokens as one engine.

The decode engine uses another page size than the prefill engine (the payload
is per token), a pool small enough that imports wait for seats, and its
prefix cache: a second import of a prompt reuses the blocks the first one
registered.
"""

import types

import jax
import numpy as np
import pytest

from conftest import run_to_completion, tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from serving.disaggregation import kv_transfer as kt
from serving.disaggregation import kv_wire
from serving.core.model_runner import ModelRunner
from serving.core.pipeline_runner import PipelineRunner
from serving.core.sampling_params import InvalidParameterError

CFG = tiny_config()
COMMON = dict(max_model_len=64, min_token_bucket=16, min_context_bucket=16, attention_backend="reference")
PREFILL = dict(page_size=8, num_pages=32, max_num_seqs=4, max_num_batched_tokens=16, **COMMON)  # shared shapes
LENGTHS = [1, 3, 7, 8, 9, 16, 17, 30]
KEYS = kv_wire.SigningKeys("a secret both workers share")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(7))


def prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, CFG.vocab_size, n)] for n in LENGTHS]


def jobs():
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = [(f"g{i}", p, greedy) for i, p in enumerate(prompts())]
    out.append(("seeded", prompts()[4], SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)))
    out.append(("lp", prompts()[6], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)))
    out.append(("one", prompts()[2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    return out


def prefill(engine, rid, prompt, sp) -> bytes:
    exports = []
    first = sp.clone()
    first.max_tokens = 1
    req = engine.make_request(rid, prompt, first)
    req.kv_export = exports.append
    engine.enqueue(req)
    run_to_completion(engine)
    (exp,) = exports
    assert exp.num_tokens == len(prompt) and exp.pages.shape[2] * exp.page_size >= len(prompt)
    return kt.encode_payload(exp, engine.cfg, engine.runner.cache.k[0].dtype, KEYS)


def decode(engine, payload: bytes):
    return kt.decode_payload(payload, KEYS, engine.cfg, engine.runner.cache.k[0].dtype, engine.max_model_len)


def submit_import(engine, rid, prompt, sp, payload: bytes):
    header, body = decode(engine, payload)
    imp = kt.to_import(header, body, engine.cfg, engine.runner.cache.k[0].dtype)
    req = engine.make_request(rid, prompt, sp)
    kt.check_import(req, imp)
    req.kv_import = imp
    engine.enqueue(req)


def test_export_import_equals_one_engine(params):
    single = LLM(config=CFG, params=params, enable_prefix_caching=False, **PREFILL)
    want = {rid: single.generate([p], sp)[0].outputs[0] for rid, p, sp in jobs()}

    pre = LLM(config=CFG, params=params, **PREFILL).engine
    dec = LLM(config=CFG, params=params, page_size=4, num_pages=64, max_num_seqs=3, max_num_batched_tokens=16,
              **COMMON).engine
    assert kt.warm_up(pre) > 0 and kt.warm_up(dec) > 0
    compiled = kt.compilation_count()
    payloads = {rid: prefill(pre, rid, p, sp) for rid, p, sp in jobs()}
    assert pre.block_manager.num_used_blocks == 0
    item = np.dtype(np.float32).itemsize
    per_token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * item
    for rid, p, _ in jobs():
        assert len(decode(dec, payloads[rid])[1]) == per_token * len(p)

    for rid, p, sp in jobs():  # all at once: more than max_num_seqs, so some wait for a seat
        submit_import(dec, rid, p, sp, payloads[rid])
    got = run_to_completion(dec)
    for rid, _, _ in jobs():
        o = got[rid].outputs[0]
        assert o.token_ids == want[rid].token_ids, rid
        assert o.finish_reason == want[rid].finish_reason
    w, g = want["lp"].logprobs, got["lp"].outputs[0].logprobs
    assert [sorted(e) for e in g] == [sorted(e) for e in w]
    for ge, we in zip(g, w):
        for tid in we:
            assert abs(ge[tid].logprob - we[tid].logprob) < 1e-5 and ge[tid].rank == we[tid].rank
    assert dec.block_manager.num_used_blocks == 0
    dec.block_manager.check_invariants(live_seq_ids=())

    # A later turn of the longest prompt hits the blocks its import registered, and still decodes the same.
    rid, p, sp = jobs()[-4]
    assert len(p) == 30
    hits_before = dec.scheduler.prefix_hit_tokens
    submit_import(dec, "again", p, sp, payloads[rid])
    again = run_to_completion(dec)["again"].outputs[0]
    assert dec.scheduler.prefix_hit_tokens - hits_before == 28  # 7 full pages of 4
    assert again.token_ids == want[rid].token_ids
    assert dec.block_manager.num_used_blocks == 0
    assert kt.compilation_count() == compiled  # after warm-up, shipping compiled nothing


def test_bad_payloads_are_refused_before_anything_is_queued(params):
    dec = LLM(config=CFG, params=params, **PREFILL).engine
    pre = LLM(config=CFG, params=params, **PREFILL).engine
    p = prompts()[3]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = prefill(pre, "x", p, sp)
    dtype = dec.runner.cache.k[0].dtype
    with pytest.raises(kv_wire.WireError, match="bad magic"):
        decode(dec, b"nope" + good[4:])
    with pytest.raises(kv_wire.WireError, match="bytes of K/V"):
        decode(dec, good[:-4 - kv_wire.TAG_BYTES])
    header, body = decode(dec, good)
    with pytest.raises(kt.PayloadError, match="bytes of K/V"):
        kt.to_import(header, body[:-4], CFG, dtype)
    with pytest.raises(kt.PayloadError, match="num_kv_heads"):
        kt.to_import({**header, "num_kv_heads": 4}, body, CFG, dtype)
    with pytest.raises(kt.PayloadError, match="dtype"):
        kt.to_import(header, body, CFG, "bfloat16")
    scaled = {**header, "arrays": header["arrays"] + [{"name": "k_scale", "shape": [len(p), 2]}]}
    with pytest.raises(kt.PayloadError, match="quantized KV"):
        kt.to_import(scaled, body, CFG, dtype)
    imp = kt.to_import(header, body, CFG, dtype)
    with pytest.raises(InvalidParameterError, match="other token ids"):
        kt.check_import(dec.make_request("y", p[:-1] + [5], sp), imp)
    with pytest.raises(InvalidParameterError, match="payload carries none"):
        kt.check_import(dec.make_request("y", p, SamplingParams(max_tokens=4, logprobs=1)), imp)
    assert dec.block_manager.num_used_blocks == 0 and not dec.has_unfinished_requests()

    # Runners the payload cannot serve say why: a quantized cache (pages with scales), a mesh over several
    # processes, pipeline stages. (Tensor parallelism in one process is supported: test_engine_tp.py.)
    assert kt.unsupported_reason(dec) is None
    quantized = types.SimpleNamespace(cache=kt.KVCache(k=[{"data": 0, "scale": 0}] * 2,
                                                       v=[{"data": 0, "scale": 0}] * 2), _spans_processes=lambda: False)
    assert "quantized" in ModelRunner.kv_transfer_unsupported(quantized)
    spanning = types.SimpleNamespace(cache=dec.runner.cache, _spans_processes=lambda: True)
    assert "one process" in ModelRunner.kv_transfer_unsupported(spanning)
    assert "pipeline" in PipelineRunner.kv_transfer_unsupported(None)

    # Aborted while waiting to be admitted, and after admission: nothing is held either way.
    submit_import(dec, "a", p, sp, good)
    dec.abort_request("a")
    assert not dec.has_unfinished_requests() and not dec._pending_imports
    submit_import(dec, "b", p, sp, good)
    dec.step()
    assert dec.block_manager.num_used_blocks == 2  # 9 tokens + the first output token, pages of 8
    dec.abort_request("b")
    assert dec.block_manager.num_used_blocks == 0 and not dec.has_unfinished_requests()
