"""Published 4-bit GPTQ checkpoints (`model.quant_gptq`): tiny random Llamas packed as AutoGPTQ's v1 format
(`tests/quant_checkpoints.py`), converted into the int4 grouped weight kind without widening, compared
with the float model of the dequantized weights and served greedily through `LLM`. transformers cannot
run these on CPU without the GPTQ packages (optimum / gptqmodel), so it is not compared here."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from model.checkpoint import load_checkpoint  # noqa: E402
from model.convert_hf import ConversionError, convert  # noqa: E402
from model.quant import GroupQuantizedArray, dequantize_grouped  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    assert_serves_greedy_tokens, awq_checkpoint, edited_quantization_config, gptq_checkpoint, logprob_differences,
)
from test_hf_parity import make_hf_model  # noqa: E402

SMALL = dict(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
PROMPTS = [[5, 17, 101, 33, 250, 7, 64, 300, 12], [9, 8, 200, 41, 3, 77]]


@pytest.fixture(scope="module", params=[32, 128])
def gptq(request, tmp_path_factory):
    """(group, hf_dir, the float model of the dequantized weights, converted dir)."""
    d = str(tmp_path_factory.mktemp(f"gptq{request.param}"))
    ref = gptq_checkpoint(make_hf_model(seed=3, **SMALL), os.path.join(d, "hf"), group=request.param)
    convert(os.path.join(d, "hf"), os.path.join(d, "out"), dtype="float32", progress=False)
    return request.param, os.path.join(d, "hf"), ref, os.path.join(d, "out")


def test_gptq_weights_load_as_int4_with_group_scales(gptq):
    group, hf_dir, ref, out = gptq
    cfg, params = load_checkpoint(out)
    assert cfg.weight_dtype == f"int4_g{group}"
    down = params.layers[0].w_down
    assert isinstance(down, GroupQuantizedArray) and down.data.dtype == jnp.int8
    assert -8 <= int(np.asarray(down.data).min()) and int(np.asarray(down.data).max()) <= 7
    assert down.data.shape == (256, 384) and down.scale.shape == (256, 384 // group)
    want = ref.model.layers[0].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_allclose(np.asarray(dequantize_grouped(down)), want, rtol=1e-6, atol=1e-7)


def test_gptq_matches_the_dequantized_model(gptq):
    _, _, ref, out = gptq
    cfg, params = load_checkpoint(out)
    for s, diff in enumerate(logprob_differences((cfg, params), ref, PROMPTS)):
        print(f"gptq g{cfg.weight_dtype} prompt {s}: max |dlogprob| {diff:.2e}")
        assert diff < 1e-4, (s, diff)


def test_gptq_serves_the_dequantized_models_greedy_tokens(gptq, tmp_path):
    group, hf_dir, ref, _ = gptq
    if group != 128:
        pytest.skip("served once (group 128): the step is the same for every group")
    assert_serves_greedy_tokens(hf_dir, ref, PROMPTS, str(tmp_path / "cache" / "jax"), weight_dtype="int4_g128")


@pytest.mark.parametrize("changes, words", [
    (dict(bits=8), "quantization_config.bits 8 is not supported for quant_method 'gptq'"),
    (dict(sym=False), "quantization_config.sym False is not supported"),
    (dict(checkpoint_format="gptq_v2"), "quantization_config.checkpoint_format 'gptq_v2' is not supported"),
    (dict(group_size=64), r"q_proj.qzeros is I32 \[2, 32\]; group_size 64 over \[256, 256\] implies I32 \[4, 32\]"),
])
def test_an_unsupported_gptq_variant_is_refused_naming_the_field(gptq, tmp_path, changes, words):
    if gptq[0] != 128:
        pytest.skip("one checkpoint is enough")
    bad = edited_quantization_config(gptq[1], str(tmp_path / "bad"), **changes)
    with pytest.raises(ConversionError, match=words):
        convert(bad, str(tmp_path / "out"), dtype="float32", progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_gptq_act_order_g_idx_is_refused_naming_desc_act(tmp_path):
    gptq_checkpoint(make_hf_model(seed=4, **SMALL), str(tmp_path / "hf"), group=128, desc_act=True)
    with pytest.raises(ConversionError, match="desc_act true is not supported"):
        convert(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("awq"))
    ref = awq_checkpoint(make_hf_model(seed=6, **SMALL), os.path.join(d, "hf"), group=128)
    convert(os.path.join(d, "hf"), os.path.join(d, "out"), dtype="float32", progress=False)
    return os.path.join(d, "hf"), ref, os.path.join(d, "out")


def test_awq_gemm_matches_the_dequantized_model_and_serves_its_greedy_tokens(awq, tmp_path):
    hf_dir, ref, out = awq
    cfg, params = load_checkpoint(out)
    assert cfg.weight_dtype == "int4_g128"
    down = params.layers[0].w_down
    np.testing.assert_allclose(np.asarray(dequantize_grouped(down)),
                               ref.model.layers[0].mlp.down_proj.weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    for s, diff in enumerate(logprob_differences((cfg, params), ref, PROMPTS)):
        print(f"awq prompt {s}: max |dlogprob| {diff:.2e}")
        assert diff < 1e-4, (s, diff)
    assert_serves_greedy_tokens(hf_dir, ref, PROMPTS, str(tmp_path / "cache" / "jax"))


@pytest.mark.parametrize("changes, words", [
    (dict(version="gemv"), "quantization_config.version 'gemv' is not supported for quant_method 'awq'"),
    (dict(bits=8), "quantization_config.bits 8 is not supported for quant_method 'awq'"),
    (dict(zero_point=False), "quantization_config.zero_point False is not supported"),
])
def test_an_unsupported_awq_variant_is_refused_naming_the_field(awq, tmp_path, changes, words):
    bad = edited_quantization_config(awq[0], str(tmp_path / "bad"), **changes)
    with pytest.raises(ConversionError, match=words):
        convert(bad, str(tmp_path / "out"), dtype="float32", progress=False)
