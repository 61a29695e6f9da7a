"""Prefill on one engine, ship the KV payload, decode on another: the same tokens as one engine.

The decode engine uses another page size than the prefill engine (the payload
is per token), a pool small enough that imports wait for seats, and its
prefix cache: a second import of a prompt reuses the blocks the first one
registered. An int8 or fp8 KV cache ships its pages as stored, with their
scales (the stacked cache of the scanned layers and the per-layer one), and a
payload of another KV dtype than the worker's is refused.
"""

import jax
import numpy as np
import pytest

from conftest import run_to_completion, tiny_config
from model.params import init_params
from serving import LLM, SamplingParams
from model.cache import StackedKVCache
from model.families import kv_bytes_per_token
from serving.disaggregation import kv_transfer as kt
from serving.disaggregation import kv_wire
from serving.features.kv_imports import KVImports
from sharding.hlo import collectives
from serving.core.sampling_params import InvalidParameterError

CFG = tiny_config()
# One context bucket (all of max_model_len): each engine compiles one step shape, not one per page bucket; what
# is checked here is the shipped KV, which does not depend on how a step pads its context.
COMMON = dict(max_model_len=64, min_token_bucket=16, min_context_bucket=64, attention_backend="reference")
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


def prefill(engine, rid, prompt, sp, cache_salt=None, lora_name=None) -> bytes:
    """`sp`'s first draw on `engine` (one sample; `min_tokens` as it acts on that draw), shipped as a
    signed payload."""
    exports = []
    first = sp.clone()
    first.max_tokens, first.n, first.min_tokens = 1, 1, min(first.min_tokens, 1)
    req = engine.make_request(rid, prompt, first, cache_salt=cache_salt, part_args={"lora_name": lora_name, "kv_export": kt.Exporter(exports.append)})
    engine.enqueue(req)
    run_to_completion(engine)
    (exp,) = exports
    assert exp.num_tokens == len(prompt) and exp.pages.shape[2] * exp.page_size >= len(prompt)
    return kt.encode_payload(exp, engine.cfg, engine.runner.kv_dtype, KEYS)


def decode(engine, payload: bytes):
    return kt.decode_payload(payload, KEYS, engine.cfg, engine.runner.kv_dtype, engine.max_model_len)


def submit_import(engine, rid, prompt, sp, payload: bytes, cache_salt=None, lora_name=None):
    header, body = decode(engine, payload)
    imp = kt.to_import(header, body, engine.cfg, engine.runner.kv_dtype)
    req = engine.make_request(rid, prompt, sp, cache_salt=cache_salt, part_args={"lora_name": lora_name, "kv_import": imp})
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
    dtype = dec.runner.kv_dtype
    with pytest.raises(kv_wire.WireError, match="bad magic"):
        decode(dec, b"nope" + good[4:])
    with pytest.raises(kv_wire.WireError, match="bytes of K/V"):
        decode(dec, good[:-4 - kv_wire.TAG_BYTES])
    header, body = decode(dec, good)
    with pytest.raises(kt.PayloadError, match="bytes of K/V"):
        kt.to_import(header, body[:-4], CFG, dtype)
    with pytest.raises(kt.PayloadError, match="num_kv_heads"):
        kt.to_import({**header, "num_kv_heads": 4}, body, CFG, dtype)
    with pytest.raises(kt.PayloadError, match="dtype 'float32' does not match .* 'bfloat16'"):
        kt.to_import(header, body, CFG, "bfloat16")
    scaled = {**header, "arrays": header["arrays"] + [{"name": "k_scale", "shape": [len(p), 2], "dtype": "float32"}]}
    with pytest.raises(kt.PayloadError, match="not those of a float32 KV cache"):
        kt.to_import(scaled, body, CFG, dtype)
    with pytest.raises(kt.PayloadError, match=f"version 2 is not {kt.VERSION}"):
        kt.to_import({**header, "version": 2}, body, CFG, dtype)
    imp = kt.to_import(header, body, CFG, dtype)
    with pytest.raises(InvalidParameterError, match="other token ids"):
        kt.check_import(dec.make_request("y", p[:-1] + [5], sp), imp)
    with pytest.raises(InvalidParameterError, match="payload carries none"):
        kt.check_import(dec.make_request("y", p, SamplingParams(max_tokens=4, logprobs=1)), imp)
    assert dec.block_manager.num_used_blocks == 0 and not dec.has_unfinished_requests()


    # Aborted while waiting to be admitted, and after admission: nothing is held either way.
    submit_import(dec, "a", p, sp, good)
    dec.abort_request("a")
    assert not dec.has_unfinished_requests() and not dec.part(KVImports).pending
    submit_import(dec, "b", p, sp, good)
    dec.step()
    assert dec.block_manager.num_used_blocks == 2  # 9 tokens + the first output token, pages of 8
    dec.abort_request("b")
    assert dec.block_manager.num_used_blocks == 0 and not dec.has_unfinished_requests()


# --- int8 / fp8 KV caches: pages travel as stored, with their scales -------------------------------------------

# (kv dtype, layer loop): the scanned layers keep one stacked cache, the unrolled ones a cache per layer.
QUANTIZED = {"int8": "auto", "fp8": "unroll"}


def quantized_jobs():
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = [(f"g{i}", p, greedy) for i, p in enumerate(prompts()) if len(p) in (3, 9, 17, 30)]
    out.append(("lp", prompts()[6], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)))
    return out


@pytest.fixture(scope="module")
def quantized(params):
    """kv dtype -> (prefill engine, decode engine, the prefill engine's own outputs of `quantized_jobs`, payloads).

    The prefill engine, without prefix caching, is also the single engine the shipped requests are compared
    with; the decode engine has another page size and a prefix cache."""
    out = {}
    for kv_dtype, loop in QUANTIZED.items():
        kw = dict(kv_cache_dtype=kv_dtype, layer_loop=loop)
        pre = LLM(config=CFG, params=params, enable_prefix_caching=False, **PREFILL, **kw)
        want = {rid: pre.generate([p], sp)[0].outputs[0] for rid, p, sp in quantized_jobs()}
        dec = LLM(config=CFG, params=params, page_size=4, num_pages=64, max_num_seqs=3, max_num_batched_tokens=16,
                  **COMMON, **kw).engine
        assert isinstance(pre.engine.runner.cache, StackedKVCache) == (loop == "auto")
        assert isinstance(dec.runner.cache, StackedKVCache) == (loop == "auto")
        if kv_dtype == "int8":  # the gather and scatter of pages with scales, every size (one cache form)
            assert kt.warm_up(dec) > 0
        payloads = {rid: prefill(pre.engine, rid, p, sp) for rid, p, sp in quantized_jobs()}
        out[kv_dtype] = pre.engine, dec, want, payloads
    return out


@pytest.mark.parametrize("kv_dtype", sorted(QUANTIZED))
def test_quantized_kv_is_shipped_with_its_scales_and_decodes_the_same(quantized, kv_dtype):
    pre, dec, want, payloads = quantized[kv_dtype]
    name = np.dtype(dec.runner.kv_dtype).name
    assert name == {"int8": "int8", "fp8": "float8_e4m3fn"}[kv_dtype]
    for rid, p, _ in quantized_jobs():
        header, body = decode(dec, payloads[rid])
        assert header["dtype"] == name and header["version"] == kt.VERSION
        assert header["arrays"] == [{"name": "k", "shape": [len(p), 2, 16], "dtype": name},
                                    {"name": "v", "shape": [len(p), 2, 16], "dtype": name},
                                    {"name": "k_scale", "shape": [len(p), 2], "dtype": "float32"},
                                    {"name": "v_scale", "shape": [len(p), 2], "dtype": "float32"}]
        # one byte per element plus a 4-byte scale per token and KV head, for K and V of every layer
        assert len(body) == len(p) * kv_bytes_per_token(CFG, dec.runner.kv_dtype) == len(p) * 2 * 2 * 2 * (16 + 4)
        imp = kt.to_import(header, body, CFG, dec.runner.kv_dtype)
        assert imp.kv.kv.dtype == dec.runner.kv_dtype and (imp.kv.scale > 0).all()

    compiled = kt.compilation_count()
    for rid, p, sp in quantized_jobs():
        submit_import(dec, rid, p, sp, payloads[rid])
    got = run_to_completion(dec)
    for rid, _, _ in quantized_jobs():
        assert got[rid].outputs[0].token_ids == want[rid].token_ids, rid
    for ge, we in zip(got["lp"].outputs[0].logprobs, want["lp"].logprobs):
        assert sorted(ge) == sorted(we)
        for tid in we:
            assert abs(ge[tid].logprob - we[tid].logprob) < 1e-5 and ge[tid].rank == we[tid].rank
    assert dec.block_manager.num_used_blocks == 0

    # The scatter writes the shipped bits and scales exactly, and the gather reads them back, in both cache forms:
    # here into free pages of the decode engine, whose form differs from the other dtype's.
    header, body = decode(dec, payloads["g7"])  # 30 tokens
    shipped = kt.to_import(header, body, CFG, dec.runner.kv_dtype).kv
    table = [40, 41, 50, 51, 52, 60, 61, 62]  # pages of 4
    kt.write(dec.runner, kt.token_slots(table, 4, 0, 30), shipped)
    pages, scales = kt.gather(dec.runner, table)
    back = kt.PrefillExport(list(range(30)), 0, 0, 4, pages, None, scales=scales).host_kv()
    np.testing.assert_array_equal(back.kv.view(np.uint8), shipped.kv.view(np.uint8))
    np.testing.assert_array_equal(back.scale, shipped.scale)
    if kv_dtype == "int8":
        assert kt.compilation_count() == compiled  # after warm-up, shipping compiled nothing


def test_a_payload_of_another_kv_dtype_is_refused_naming_both(quantized):
    """int8 pages cannot go into an fp8 or float cache, nor float pages into a quantized one: refused (HTTP 400)
    before anything is read or queued, with both dtypes named."""
    int8_payload = next(iter(quantized["int8"][3].values()))
    fp8_dec = quantized["fp8"][1]
    float_export = kt.PrefillExport([5, 6, 7], 9, 0, 8, np.ones((CFG.num_layers, 2, 1, 8, 2, 16), np.float32), None)
    float_payload = kt.encode_payload(float_export, CFG, np.float32, KEYS)
    cases = [(int8_payload, fp8_dec.runner.kv_dtype, "'int8'", "'float8_e4m3fn'"),
             (int8_payload, np.float32, "'int8'", "'float32'"),
             (float_payload, quantized["int8"][1].runner.kv_dtype, "'float32'", "'int8'")]
    for payload, dtype, theirs, mine in cases:
        with pytest.raises(kt.PayloadError) as e:
            kt.decode_payload(payload, KEYS, CFG, dtype, 64)
        assert e.value.status == 400
        assert f"KV payload dtype {theirs} does not match this worker's KV cache dtype {mine}" in str(e.value)
    # The float payload itself is sound: a float32 worker takes it.
    header, body = kt.decode_payload(float_payload, KEYS, CFG, np.float32, 64)
    assert kt.to_import(header, body, CFG, np.float32).kv.kv.shape == (CFG.num_layers, 2, 3, 2, 16)
    assert fp8_dec.block_manager.num_used_blocks == 0 and not fp8_dec.has_unfinished_requests()


# --- pipeline stages: each stage ships its own layers' pages, in the payload of an unstaged engine ------------

# Four layers, two per stage: a payload in stage-local order (or with one stage's layers twice) differs from
# the unstaged engine's.
CFG4 = tiny_config(num_layers=4)
# One step shape per engine (16 tokens, a 32-token context); imports write every token (no prefix cache).
STAGED = dict(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, min_context_bucket=32,
              attention_backend="reference", enable_prefix_caching=False)


def staged_jobs():
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [(f"s{i}", p, sp) for i, p in enumerate(prompts()) if len(p) in (3, 9, 17)]


@pytest.fixture(scope="module", params=[None, "int8"], ids=["float", "int8"])
def staged(request):
    """(plain engine, PP=2 engine with 2 microbatches, the plain engine's own outputs of `staged_jobs`) for a
    KV cache dtype; the two use different page sizes."""
    host = init_params(CFG4, jax.random.key(5))
    kw = {} if request.param is None else dict(kv_cache_dtype=request.param)
    plain = LLM(config=CFG4, params=host, page_size=8, num_pages=24, **STAGED, **kw)
    want = {rid: plain.generate([p], sp)[0].outputs[0].token_ids for rid, p, sp in staged_jobs()}
    piped = LLM(config=CFG4, params=host, page_size=4, num_pages=48, pipeline_parallel_size=2, num_microbatches=2,
                **STAGED, **kw)
    assert piped.engine.runner.layout.pipeline_parallel_size == 2 and len(piped.engine.runner.cache.k) == 2
    return plain.engine, piped.engine, want


def test_pipeline_stages_export_to_and_import_from_a_plain_engine(staged):
    plain, piped, want = staged
    from_piped = {rid: prefill(piped, rid, p, sp) for rid, p, sp in staged_jobs()}
    from_plain = {rid: prefill(plain, rid, p, sp) for rid, p, sp in staged_jobs()}
    # The same payload as the plain engine's: every layer's K/V (and scales) in global layer order.
    for rid, p, _ in staged_jobs():
        a = kt.to_import(*decode(plain, from_piped[rid]), CFG4, plain.runner.kv_dtype).kv
        b = kt.to_import(*decode(plain, from_plain[rid]), CFG4, plain.runner.kv_dtype).kv
        assert a.kv.shape == b.kv.shape == (4, 2, len(p), 2, 16)
        if a.scale is None:
            np.testing.assert_allclose(a.kv, b.kv, rtol=1e-5, atol=1e-5)
        else:  # int8: the same values up to a step of the quantization
            deq = lambda h: h.kv.astype(np.float32) * h.scale[..., None]  # noqa: E731
            np.testing.assert_allclose(deq(a), deq(b), atol=1.01 * np.maximum(a.scale, b.scale).max())
    for engine, payloads in ((plain, from_piped), (piped, from_plain)):
        for rid, p, sp in staged_jobs():
            submit_import(engine, rid, p, sp, payloads[rid])
        got = run_to_completion(engine)
        assert {rid: got[rid].outputs[0].token_ids for rid, _, _ in staged_jobs()} == want
        assert engine.block_manager.num_used_blocks == 0


def test_staged_pages_are_written_and_read_back_exactly(staged):
    """The scatter writes each global layer into its stage's block of the page axis and the gather reads it
    back: the shipped bits, in free pages of the staged cache."""
    plain, piped, _ = staged
    rid, p, sp = staged_jobs()[-1]  # 17 tokens
    shipped = kt.to_import(*decode(piped, prefill(plain, rid, p, sp)), CFG4, piped.runner.kv_dtype).kv
    table = [40, 41, 30, 47, 46]  # pages of 4
    kt.write(piped.runner, kt.token_slots(table, 4, 0, 17), shipped)
    pages, scales = kt.gather(piped.runner, table)
    back = kt.PrefillExport(list(range(17)), 0, 0, 4, pages, None, scales=scales).host_kv()
    np.testing.assert_array_equal(back.kv.view(np.uint8), shipped.kv.view(np.uint8))
    if shipped.scale is not None:
        np.testing.assert_array_equal(back.scale, shipped.scale)
    # Each stage holds its own two layers: stage 1's block of stage-local layer 0 is global layer 2.
    k0 = np.asarray(jax.tree.leaves(piped.runner.cache.k[0])[0])  # pages [2 * 48, 4, kv_heads, head_dim]
    np.testing.assert_array_equal(k0[48 + 40].view(np.uint8), shipped.kv[2, 0, :4].view(np.uint8))
    np.testing.assert_array_equal(k0[40].view(np.uint8), shipped.kv[0, 0, :4].view(np.uint8))
    # Each stage reads and writes its own block: the compiled programs move nothing between devices.
    cache = piped.runner.cache
    shardings = tuple(x.sharding for x in jax.tree.leaves(cache))
    slots, padded = kt.padded_tokens(kt.token_slots(table, 4, 0, 17), shipped, 48 * 4)
    programs = [kt.gather_jit.lower(cache, kt.padded_pages(table), stages=2),
                kt.write_jit.lower(cache, slots, padded.kv, padded.scale, cache_shardings=shardings, stages=2)]
    for lowered in programs:
        assert collectives(lowered.compile().as_text()) == []
