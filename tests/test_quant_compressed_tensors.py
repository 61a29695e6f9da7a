"""compressed-tensors checkpoints (`model.quant_compressed`): tiny random Llamas quantized and saved by the
compressed-tensors library itself (w4a16 in groups, FP8 per channel and per tensor, int8 per channel), converted
into Ridgeline's weight kinds without widening, compared with transformers loading the same checkpoint (its
compressed-tensors decompression; activations not quantized, as Ridgeline serves them) and served greedily."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from model.checkpoint import load_checkpoint  # noqa: E402
from model.convert_hf import ConversionError, convert  # noqa: E402
from model.quant import GroupQuantizedArray, QuantizedArray  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    assert_serves_greedy_tokens, compressed_tensors_checkpoint, edited_quantization_config, logprob_differences,
)
from test_hf_parity import make_hf_model  # noqa: E402
from test_quant_int4_checkpoints import PROMPTS, SMALL  # noqa: E402

KINDS = {"w4a16": ("int4_g32", GroupQuantizedArray, jnp.int8), "fp8-channel": ("fp8", QuantizedArray, jnp.float8_e4m3fn),
         "fp8-tensor": ("fp8", QuantizedArray, jnp.float8_e4m3fn), "w8a8-channel": ("int8", QuantizedArray, jnp.int8)}


@pytest.fixture(scope="module", params=sorted(KINDS))
def checkpoint(request, tmp_path_factory):
    """(scheme, hf_dir, transformers' model of it, converted dir)."""
    d = str(tmp_path_factory.mktemp(request.param))
    hf_dir = os.path.join(d, "hf")
    ref = compressed_tensors_checkpoint(make_hf_model(seed=5, **SMALL), hf_dir, request.param)
    convert(hf_dir, os.path.join(d, "out"), dtype="float32", progress=False)
    return request.param, hf_dir, ref, os.path.join(d, "out")


def test_weights_load_as_the_kind_the_scheme_maps_to(checkpoint):
    scheme, _, ref, out = checkpoint
    kind, cls, dtype = KINDS[scheme]
    cfg, params = load_checkpoint(out)
    assert cfg.weight_dtype == kind
    down = params.layers[0].w_down
    assert isinstance(down, cls) and down.data.dtype == dtype and down.data.shape == (256, 384)
    if scheme == "w4a16":
        assert down.scale.shape == (256, 384 // 32)
        assert -8 <= int(np.asarray(down.data).min()) and int(np.asarray(down.data).max()) <= 7
    else:
        assert down.scale.shape == (256,)
        if scheme == "fp8-tensor":
            assert np.unique(np.asarray(down.scale)).size == 1


def test_logprobs_match_transformers_on_the_same_checkpoint(checkpoint):
    scheme, _, ref, out = checkpoint
    for s, diff in enumerate(logprob_differences(load_checkpoint(out), ref, PROMPTS)):
        print(f"compressed-tensors {scheme} prompt {s}: max |dlogprob| {diff:.2e}")
        assert diff < 2e-4, (scheme, s, diff)  # float32 rounding: the scale multiplies the matmul's output here


def test_serves_the_greedy_tokens_of_transformers(checkpoint, tmp_path):
    scheme, hf_dir, ref, _ = checkpoint
    if scheme not in ("w4a16", "fp8-channel"):
        pytest.skip("served for two kinds: the step is the same program for the rest")
    assert_serves_greedy_tokens(hf_dir, ref, PROMPTS, str(tmp_path / "cache" / "jax"), weight_dtype=KINDS[scheme][0])


def _edit_weights(qc: dict, **changes) -> dict:
    group = dict(qc["config_groups"]["group_0"])
    group["weights"] = {**group["weights"], **changes}
    return {"config_groups": {"group_0": group}}


@pytest.mark.parametrize("edit, words", [
    (lambda qc: _edit_weights(qc, symmetric=False), "weights.symmetric False is not supported"),
    (lambda qc: _edit_weights(qc, num_bits=8), "weights.num_bits 8 is not supported"),
    (lambda qc: _edit_weights(qc, strategy="channel"), "weights.strategy 'channel' is not supported"),
    (lambda qc: _edit_weights(qc, actorder="group"), "weights.actorder 'group' is not supported"),
    (lambda qc: {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    (lambda qc: {"format": "nvfp4-pack-quantized",
                 "config_groups": {"group_0": {**qc["config_groups"]["group_0"], "format": "nvfp4-pack-quantized"}}},
     "format 'nvfp4-pack-quantized' is not supported"),
])
def test_an_unsupported_variant_is_refused_naming_the_field(checkpoint, tmp_path, edit, words):
    scheme, hf_dir, _, _ = checkpoint
    if scheme != "w4a16":
        pytest.skip("refusals checked on one checkpoint")
    import json

    with open(os.path.join(hf_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    edited = edited_quantization_config(hf_dir, str(tmp_path / "edited"), **edit(qc))
    with pytest.raises(ConversionError, match=words):
        convert(edited, str(tmp_path / "out"), dtype="float32", progress=False)


def test_two_way_tensor_parallelism_draws_the_same_tokens(checkpoint, tmp_path):
    """The kinds shard as float weights do (data and scales split by the same rule table): TP=2 draws the
    one-device greedy tokens."""
    scheme, hf_dir, _, _ = checkpoint
    if scheme not in ("w4a16", "w8a8-channel"):
        pytest.skip("a grouped and a per-channel kind (fp8 shards as int8 does)")
    from serving import LLM, SamplingParams

    engine = dict(compilation_cache_dir=str(tmp_path / "cache"), max_num_seqs=2, max_num_batched_tokens=32,
                  num_pages=16, max_model_len=64, dtype="float32")
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(model=hf_dir, **engine).generate(PROMPTS, sp)]
    two = LLM(model=hf_dir, tensor_parallel_size=2, **engine)
    assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, sp)] == one
