"""Weight and KV-cache quantization (model.quant): error bounds, declarations, checkpoints, quality, engine.

The quality thresholds are checked for teeth: the same per-channel scheme
with 4-bit rounding, and int8 with a scale bug, must fail them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import tiny_config
from model import quant
from model.cache import KVCache, init_cache, pack_batch
from model.checkpoint import load_checkpoint, save_checkpoint
from model.families import kv_bytes_per_token
from model.forward import forward
from model.linear import linear
from model.params import Weights, abstract_params, flatten_params, init_params, is_array_info
from model.quant import QuantizedArray
from model.quantize import quantize_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def num_out_dims(name: str) -> int:
    """Output dims of a linear weight ([out..., in...]): (heads, head_dim) for wq/wk/wv, one otherwise."""
    return 2 if name in ("wq", "wk", "wv") else 1


def spread_weight(rng, shape, num_out_dims):
    """Normal [out..., in...] weights whose output channels (the first `num_out_dims` dims) span
    three decades of magnitude, one channel all zero."""
    out_shape = shape[:num_out_dims]
    mag = np.exp(rng.uniform(-3.5, 3.5, out_shape)).astype(np.float32)
    w = rng.standard_normal(shape).astype(np.float32) * mag.reshape(out_shape + (1,) * (len(shape) - num_out_dims))
    w.reshape(*out_shape, -1)[(0,) * len(out_shape)] = 0.0
    return jnp.asarray(w)


@pytest.mark.parametrize("shape,num_out", [((4, 16, 64), 2), ((64, 4, 16), 1), ((40, 96), 1)])
def test_quantize_round_trip_error_bounds(shape, num_out):
    w = spread_weight(np.random.RandomState(0), shape, num_out)
    w32 = np.asarray(w)
    in_axes = tuple(range(num_out, len(shape)))
    for name in ("int8", "fp8"):
        q = quant.quantize(w, name, num_out)
        assert q.data.dtype == quant.QUANT_DTYPES[name] and q.data.shape == shape
        assert q.scale.dtype == jnp.float32 and q.scale.shape == shape[:num_out]
        s = np.asarray(q.scale).reshape(shape[:num_out] + (1,) * len(in_axes))  # per channel, over its inputs
        err = np.abs(np.asarray(quant.dequantize(q)) - w32)
        if name == "int8":
            bound = s / 2 * (1 + 1e-5)
        else:  # 3 mantissa bits: half an ulp is 1/16 of the value; subnormal steps are 2**-9 * s
            bound = np.maximum(np.abs(w32) / 16, s / 1024) * (1 + 1e-5)
        assert (err <= bound + 1e-12).all(), f"{name}: worst excess {np.max(err - bound)}"
        # The channel max is represented exactly, and a zero channel stays zero (scale 0, no NaN).
        amax = np.max(np.abs(w32), axis=in_axes)
        np.testing.assert_allclose(np.max(np.abs(np.asarray(quant.dequantize(q))), axis=in_axes), amax, rtol=1e-6)
        assert np.isfinite(s).all() and s.reshape(-1)[0] == 0
        # Not trivially exact: the rounding error is real and of the bound's order.
        assert err.max() > 0.1 * bound.max()


def test_linear_with_quantized_weight_is_the_einsum_of_its_dequantized_form():
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    # The einsums of model.forward, weights [out..., in...].
    for spec, shape, num_out, xin in (("te,hde->thd", (4, 16, 64), 2, x), ("te,fe->tf", (40, 64), 1, x),
                                      ("thd,ehd->te", (64, 4, 16), 1, x.reshape(5, 4, 16)),
                                      ("tf,ef->te", (24, 64), 1, x)):
        w = spread_weight(rng, shape, num_out)
        for name in ("int8", "fp8"):
            q = quant.quantize(w, name, num_out)
            got = linear(spec, xin, q)
            want = jnp.einsum(spec, xin, quant.dequantize(q), precision="highest")
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(
                np.abs(want).max()))
    assert linear("te,fe->tf", x, w := jnp.ones((3, 64))).shape == (5, 3)  # float weights pass through
    np.testing.assert_array_equal(linear("te,fe->tf", x, w), jnp.einsum("te,fe->tf", x, w))
    # A spec whose output does not end in the weight's output dims is refused, not mis-scaled.
    with pytest.raises(ValueError, match="output dims"):
        linear("te,hde->dht", x, quant.quantize(spread_weight(rng, (4, 16, 64), 2), "int8", 2))


def test_quantized_declarations_shard_scales_with_their_columns():
    from sharding.mesh import make_mesh
    from sharding.shardings import cache_shardings, param_shardings

    cfg = tiny_config(weight_dtype="int8", vocab_size=96)
    decl = Weights.declare(cfg)
    layer = decl.layers[0]
    assert isinstance(layer.wq, QuantizedArray) and not isinstance(layer.attn_norm, QuantizedArray)
    assert layer.wq.data.dtype == jnp.int8 and layer.wq.scale.logical_axes == ("q_heads", "head_dim")
    assert layer.wo.scale.shape == (cfg.hidden_size,) and layer.wo.scale.logical_axes == ("embed",)
    assert decl.embed.dtype == cfg.jnp_dtype  # lookup table: not quantized
    names = set(flatten_params(abstract_params(cfg)))
    assert {"layers.0.wq.data", "layers.0.wq.scale", "lm_head.data", "lm_head.scale", "embed"} <= names
    shardings = param_shardings(cfg, make_mesh(tensor=2))
    sl = shardings.layers[0]
    assert sl.wq.data.spec == jax.sharding.PartitionSpec("tensor")
    assert sl.wq.scale.spec == jax.sharding.PartitionSpec("tensor")  # split like wq's head rows
    assert sl.w_gate.scale.spec == jax.sharding.PartitionSpec("tensor")
    assert sl.w_down.scale.spec == jax.sharding.PartitionSpec()  # row-parallel: output replicated
    cache = cache_shardings(cfg, make_mesh(tensor=2), num_pages=8, page_size=4, dtype=jnp.int8)
    assert cache.k[0].scale.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    # Random init of a quantized config yields the quantized tree of the declarations.
    params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    want = jax.tree.map(lambda i: (i.shape, jnp.dtype(i.dtype)), decl, is_leaf=is_array_info)
    assert shapes == want


def test_orbax_round_trip_stores_the_quantized_form(tmp_path):
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(1))
    qcfg, qparams = quantize_params(params, cfg, "fp8")
    save_checkpoint(str(tmp_path / "q"), qparams, qcfg, storage_dtype=jnp.bfloat16)
    with open(tmp_path / "q" / "model_config.json") as f:
        assert json.load(f)["weight_dtype"] == "fp8"
    assert "weight_dtype" not in cfg.to_dict()  # float checkpoints keep their old config file
    cfg2, restored = load_checkpoint(str(tmp_path / "q"))
    assert cfg2 == qcfg
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    for a, b in zip(jax.tree.leaves(qparams, is_leaf=is_q), jax.tree.leaves(restored, is_leaf=is_q), strict=True):
        if is_q(a):  # stored as they are, whatever the storage dtype of the float weights
            assert b.data.dtype == jnp.float8_e4m3fn and b.scale.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(a.data.astype(jnp.float32)),
                                          np.asarray(b.data.astype(jnp.float32)))
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
        else:  # norms and the embedding went through bf16
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-2)
    on_disk = sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(tmp_path / "q" / "params") for n in fs)
    assert on_disk < 0.5 * sum(x.nbytes for x in jax.tree.leaves(params))  # about a quarter of fp32
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(qparams, qcfg, "int8")


def _hf_dir(tmp_path, cfg, params):
    """A Hugging Face Llama directory (config.json + safetensors) holding `params`."""
    from safetensors.numpy import save_file

    h, d = cfg.hidden_size, cfg.head_dim
    np32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    t = {"model.embed_tokens.weight": np32(params.embed), "model.norm.weight": np32(params.final_norm),
         "lm_head.weight": np32(params.lm_head)}
    for i, layer in enumerate(params.layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t[p + "input_layernorm.weight"] = np32(layer.attn_norm)
        t[p + "post_attention_layernorm.weight"] = np32(layer.mlp_norm)
        for name, w in (("q_proj", layer.wq), ("k_proj", layer.wk), ("v_proj", layer.wv)):
            t[a + name + ".weight"] = np32(np.asarray(w).reshape(-1, h))
        t[a + "o_proj.weight"] = np32(np.asarray(layer.wo).reshape(h, -1))
        t[m + "gate_proj.weight"] = np32(layer.w_gate)
        t[m + "up_proj.weight"] = np32(layer.w_up)
        t[m + "down_proj.weight"] = np32(layer.w_down)
    os.makedirs(tmp_path, exist_ok=True)
    save_file(t, str(tmp_path / "model.safetensors"))
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=h,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=d,
              rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
              torch_dtype="float32")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf, f)
    return str(tmp_path)


def test_convert_hf_weight_dtype_writes_a_quantized_checkpoint(tmp_path):
    from model.convert_hf import ConversionError, convert

    cfg = tiny_config(vocab_size=96)  # divisible by the tensor split below
    params = init_params(cfg, jax.random.key(2))
    hf_dir = _hf_dir(tmp_path / "hf", cfg, params)
    out = convert(hf_dir, str(tmp_path / "out"), progress=False, weight_dtype="int8")
    assert out.weight_dtype == "int8"
    _, loaded = load_checkpoint(str(tmp_path / "out"))
    _, want = quantize_params(params, cfg, "int8")
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    # Restored straight into tensor-parallel shardings: each device reads its columns and their scales.
    from sharding.mesh import make_mesh
    from sharding.shardings import param_shardings

    _, sharded = load_checkpoint(str(tmp_path / "out"), param_shardings(out, make_mesh(tensor=2)))
    wq = sharded.layers[1].wq
    assert wq.scale.sharding.spec == jax.sharding.PartitionSpec("tensor")
    assert wq.data.addressable_shards[0].data.shape == (cfg.num_heads // 2, cfg.head_dim, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(wq.scale), np.asarray(want.layers[1].wq.scale))
    with pytest.raises(ConversionError, match="weight_dtype"):
        convert(hf_dir, str(tmp_path / "bad"), progress=False, weight_dtype="int4")


# --- quality of the embedded model -----------------------------------------------------------------

N_PROMPTS, PROMPT_LEN, PAGE = 16, 64, 16
# (weight dtype, kv dtype) -> (min top-1 agreement, max logit RMS error / logit std, max mean KL nats)
THRESHOLDS = {
    ("int8", None): (0.99, 0.01, 2e-4),
    ("fp8", None): (0.975, 0.03, 2e-3),
    (None, "int8"): (0.99, 0.01, 2e-4),
    (None, "fp8"): (0.97, 0.04, 3e-3),
}


@pytest.fixture(scope="module")
def embedded():
    from serving.llm import default_checkpoint_dir

    return load_checkpoint(default_checkpoint_dir())


@pytest.fixture(scope="module")
def heldout_batch(embedded):
    """Teacher-forced logits at every position of many held-out prompts, in one ragged batch."""
    from model.tokenizer import ByteTokenizer
    from model.train import stdlib_files, token_stream

    cfg, _ = embedded
    stream = token_stream(stdlib_files()[1], ByteTokenizer(cfg.vocab_size))
    starts = np.random.RandomState(0).choice(len(stream) - PROMPT_LEN, N_PROMPTS, replace=False)
    pps = PROMPT_LEN // PAGE
    chunks = [(stream[s:s + PROMPT_LEN].tolist(), 0, list(range(i * pps, (i + 1) * pps)))
              for i, s in enumerate(starts)]
    return pack_batch(chunks, page_size=PAGE, num_pages=N_PROMPTS * pps, num_tokens=N_PROMPTS * PROMPT_LEN,
                      max_seqs=N_PROMPTS, pages_per_seq=pps, all_logits=True)


_forward = jax.jit(forward, static_argnames=("cfg", "backend"))


def _logits(cfg, params, batch, kv_dtype=None):
    tokens, md = batch
    cache = init_cache(cfg, N_PROMPTS * PROMPT_LEN // PAGE, PAGE, kv_dtype)
    return np.asarray(_forward(params, cache, tokens, md, cfg=cfg, backend="reference")[0])


def _quality(logits, ref):
    lp, lr = jax.nn.log_softmax(logits), jax.nn.log_softmax(ref)
    return (float(np.mean(logits.argmax(-1) == ref.argmax(-1))),
            float(np.sqrt(np.mean((logits - ref) ** 2)) / np.std(ref)),
            float(jnp.mean(jnp.sum(jnp.exp(lr) * (lr - lp), axis=-1))))


def _passes(q, limits):
    return q[0] >= limits[0] and q[1] <= limits[1] and q[2] <= limits[2]


def test_quantized_forward_matches_full_precision_on_the_embedded_model(embedded, heldout_batch):
    cfg, params = embedded
    ref = _logits(cfg, params, heldout_batch)
    for (wd, kvd), limits in THRESHOLDS.items():
        qcfg, qparams = quantize_params(params, cfg, wd) if wd else (cfg, params)
        q = _quality(_logits(qcfg, qparams, heldout_batch, kvd), ref)
        assert _passes(q, limits), f"weights {wd}, kv {kvd}: (agreement, rms, kl) = {q}, limits {limits}"

    # The thresholds have teeth: 4-bit rounding with the same per-channel scales, and int8 whose
    # data is stored at twice its scale (a scale bug clipping half the range), both fail them.
    def coarse(w, num_out, levels):
        q = quant.quantize(w, "int8", num_out)
        data = jnp.clip(jnp.round(q.data.astype(jnp.float32) * levels / 127), -levels, levels) * 127 / levels
        return quant.dequantize(QuantizedArray(data, q.scale))

    def broken(levels, stretch=1.0):
        def fix(layer):
            return dataclasses.replace(layer, **{k: coarse(getattr(layer, k) * stretch, num_out_dims(k), levels)
                                                 / stretch for k in LINEAR})
        return dataclasses.replace(params, layers=[fix(layer) for layer in params.layers])

    for name, bad in (("int4-level rounding", broken(7)),):
        q = _quality(_logits(cfg, bad, heldout_batch), ref)
        assert not _passes(q, THRESHOLDS[("int8", None)]) and not _passes(q, THRESHOLDS[("fp8", None)]), (name, q)
    clipped = dataclasses.replace(params, layers=[dataclasses.replace(layer, **{
        k: quant.dequantize(QuantizedArray(quant.to_storage(
            (qk := quant.quantize(getattr(layer, k), "int8", num_out_dims(k))).data.astype(jnp.float32) * 2,
            jnp.int8), qk.scale)) for k in LINEAR}) for layer in params.layers])
    q = _quality(_logits(cfg, clipped, heldout_batch), ref)
    assert not _passes(q, THRESHOLDS[("fp8", None)]), ("scale bug", q)


# --- the engine ----------------------------------------------------------------------------------------

def test_llm_generate_with_int8_weights_and_int8_kv(embedded):
    from serving.llm import LLM
    from serving.core.model_runner import compilation_count
    from serving.core.sampling_params import SamplingParams

    prompts = ["def main(", "import os\nimport ", "class Foo:\n    def __init__(self", "for i in range(",
               "    return ", "# Copyright"]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    # One step shape (16 tokens, 4 sequences, 4 pages) keeps compilation to one program per engine.
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, num_pages=48, max_model_len=64)
    llm = LLM(weight_dtype="int8", kv_cache_dtype="int8", warmup=True, **kw)
    assert llm.config.weight_dtype == "int8"
    assert llm.engine.runner.params.layers[0].wq.data.dtype == jnp.int8
    assert jax.tree.leaves(llm.engine.runner.cache.k)[0].dtype == jnp.int8  # (per-layer or stacked pages)
    compiled = compilation_count()
    batched = llm.generate(prompts, sp)
    alone = llm.generate(prompts[2], sp)[0]
    assert alone.outputs[0].token_ids == batched[2].outputs[0].token_ids
    assert compilation_count() == compiled  # warm-up covered every step shape of the quantized model
    assert all(len(o.outputs[0].token_ids) == 12 for o in batched)
    # Tensor parallelism over 4 devices (2 KV heads: replicated, each device slices its head's
    # pages and scales): the same greedy tokens.
    tp = LLM(weight_dtype="int8", kv_cache_dtype="int8", tensor_parallel_size=4, **kw).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in tp] == [o.outputs[0].token_ids for o in batched]
    # Against the float model: greedy continuations agree on most prompts' first tokens.
    ref = LLM(**kw).generate(prompts, sp)
    same = sum(a.outputs[0].token_ids[:6] == b.outputs[0].token_ids[:6] for a, b in zip(ref, batched))
    assert same >= len(prompts) - 1, same
    # The real bytes: int8 K/V plus one fp32 scale per token and head; streamed weights shrink.
    cfg = llm.config
    assert llm.engine.describe()["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    float_bytes = quant.streamed_weight_bytes(embedded[1], embedded[0])
    assert quant.streamed_weight_bytes(llm.engine.runner.params, cfg) < 0.45 * float_bytes
    # The MBU gauge's cost model and the startup log use those real counts.
    from serving import server
    from serving.api.http_metrics import ModelCost

    cost = ModelCost.from_config(cfg, streamed_weight_bytes=server._streamed_weight_bytes(llm.engine.runner, cfg),
                                 kv_bytes_per_token=server._kv_bytes_per_token(llm.engine))
    assert cost.weight_bytes == quant.streamed_weight_bytes(llm.engine.runner.params, cfg)
    assert cost.kv_bytes_per_token == llm.engine.describe()["kv_bytes_per_token"]
    log = "\n".join(server.describe_startup(llm))
    assert "linear weights int8" in log and "(1.1 KiB per token, int8)" in log


def test_kv_pool_sizing_uses_real_bytes_per_token():
    from serving.core.engine import EngineConfig, default_num_pages

    cfg = tiny_config()
    config = EngineConfig(page_size=16, host_kv_cache_bytes=2**20, max_num_seqs=1000)
    for dtype, per_token in ((None, 2 * 2 * 2 * 16 * 4), (jnp.int8, 2 * 2 * 2 * (16 + 4)),
                             (jnp.float8_e4m3fn, 2 * 2 * 2 * (16 + 4))):
        assert kv_bytes_per_token(cfg, dtype) == per_token
        assert default_num_pages(cfg, config, 1024, dtype) == 2**20 // (per_token * 16)
        cache = init_cache(cfg, 8, 16, dtype)
        assert sum(x.nbytes for x in jax.tree.leaves(cache)) == 8 * 16 * per_token


def test_bad_quantization_flags_are_clear_errors():
    from serving.core.engine import Engine, EngineConfig
    from serving.llm import LLM

    with pytest.raises(ValueError, match=r"weight_dtype must be one of \['auto', 'int8', 'fp8'\], got 'int4'"):
        LLM(weight_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(kv_cache_dtype="int3")
    cfg = tiny_config()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(cfg, None, None, EngineConfig(kv_cache_dtype="e5m2"))
    with pytest.raises(ValueError, match="weight_dtype must be None, 'int8', 'fp8' or a grouped kind such as 'fp8_g128', got 'int4'"):
        tiny_config(weight_dtype="int4")
    proc = subprocess.run([sys.executable, "-m", "serving.server", "--weight_dtype=int4"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode != 0 and "weight_dtype" in proc.stderr and "int8" in proc.stderr


def test_backend_without_quantized_kv_support_is_refused():
    from kernels_pallas import AttentionBackend, get_backend, register_backend

    ref = get_backend("reference")
    register_backend("plain_float_only", lambda: AttentionBackend("plain_float_only", ref.attention, ref.write_kv))
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(3))
    tokens, md = pack_batch([([5, 6, 7], 0, [0])], page_size=8, num_pages=4, num_tokens=4, max_seqs=2,
                            pages_per_seq=2)
    cache = init_cache(cfg, 4, 8, "int8")
    assert isinstance(cache.k[0], QuantizedArray) and isinstance(KVCache.declare(cfg, 4, 8, "fp8").v[0],
                                                                 QuantizedArray)
    with pytest.raises(ValueError, match="'plain_float_only' cannot read a quantized"):
        _forward(params, cache, tokens, md, cfg=cfg, backend="plain_float_only")
    logits, cache = _forward(params, cache, tokens, md, cfg=cfg, backend="reference")
    assert np.isfinite(np.asarray(logits)).all() and float(jnp.abs(cache.k[0].scale).sum()) > 0


def test_plan_counts_real_quantized_bytes():
    from model.families import config_by_name, num_params
    from sharding.estimate import PlanInputs, plan
    from sharding.hardware import get_gpu

    cfg = config_by_name("llama3-8b")
    bf16 = plan(PlanInputs(cfg=cfg, gpu=get_gpu("h200")))
    q = plan(PlanInputs(cfg=cfg, gpu=get_gpu("h200"), weight_dtype="int8", kv_dtype="int8"))
    h, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    d, nq, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    linear = L * (h * d * (2 * nq + 2 * nkv) + 3 * h * f) + h * v  # one byte each (lm_head included)
    scales = 4 * (L * (d * (nq + 2 * nkv) + h + 2 * f + h) + v)  # fp32, one per output channel
    floats = 2 * (v * h + (2 * L + 1) * h)  # bf16 embedding table and norms
    assert q["model"]["weight_bytes_total"] == linear + scales + floats
    assert q["model"]["params"] == bf16["model"]["params"] == num_params(cfg)
    assert q["memory"]["kv_bytes_per_token"] == 2 * L * nkv * (d + 4)
    assert q["inputs"]["kv_dtype"] == "int8"
    assert plan(PlanInputs(cfg=cfg, gpu=get_gpu("h200"), weight_dtype="int8"))["inputs"]["kv_dtype"] == "bfloat16"
    # Decode at batch 1 streams about half the bytes, so its ceiling nearly doubles.
    assert 1.8 < q["decode"]["tokens_per_s"] / bf16["decode"]["tokens_per_s"] < 2.0


def test_copy_on_write_copies_quantized_pages_and_their_scales():
    from serving.core.model_runner import _copy_jit

    cfg = tiny_config(num_layers=1)
    rng = np.random.RandomState(5)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 50, x.dtype),
                         init_cache(cfg, 6, 4, "fp8"))
    before = jax.tree.map(np.asarray, cache)
    out = _copy_jit(cache, np.array([1, 3], np.int32), np.array([4, 6], np.int32))  # 6 = padding: dropped
    for got, old in zip(jax.tree.leaves(out), jax.tree.leaves(before)):
        got = np.asarray(got)
        np.testing.assert_array_equal(got[4], old[1])
        np.testing.assert_array_equal(np.delete(got, 4, axis=0), np.delete(old, 4, axis=0))
    assert isinstance(out.k[0], QuantizedArray) and out.k[0].scale.shape == (6, 4, cfg.num_kv_heads)
