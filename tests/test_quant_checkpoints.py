"""Published quantized checkpoints (`model.quant_formats`): tiny random Llamas written in each format
(`tests/quant_checkpoints.py`), converted without widening the weights, compared with the float model
of the dequantized weights (and with transformers loading the checkpoint itself where it can on CPU),
and served greedily through `LLM`."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model.checkpoint import load_checkpoint  # noqa: E402
from model.convert_hf import ConversionError, convert  # noqa: E402
from model.quant import GroupQuantizedArray, dequantize_grouped  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    assert_serves_greedy_tokens, edited_quantization_config, fp8_block_checkpoint,
)
from test_hf_parity import Runner, hf_logits, make_hf_model, run_one_call  # noqa: E402

# Every dimension but head_dim ends in a partial 128-block: hidden 192, kv rows 64, ffw 320.
EDGE = dict(vocab_size=448, hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1, head_dim=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
# Whole blocks only (what transformers' CPU dequantizer reads), and an untied float lm_head.
WHOLE = dict(EDGE, hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=False)
PROMPTS = [[5, 17, 101, 33, 250, 7, 64, 300, 12], [9, 8, 200, 41, 3, 77], [400, 11, 5, 90, 18, 23, 1, 60]]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def fp8_edge(tmp_path_factory):
    """(hf_dir, the float model of the dequantized weights, converted dir)."""
    d = str(tmp_path_factory.mktemp("fp8_edge"))
    ref = fp8_block_checkpoint(make_hf_model(seed=3, **EDGE), os.path.join(d, "hf"))
    convert(os.path.join(d, "hf"), os.path.join(d, "out"), dtype="float32", progress=False)
    return os.path.join(d, "hf"), ref, os.path.join(d, "out")


def _our_logprobs(ckpt):
    cfg, params = load_checkpoint(ckpt)
    runner = Runner(cfg, params, seed=0)
    return {s: log_softmax(v) for s, v in run_one_call(runner, PROMPTS).items()}


def test_fp8_block_weights_load_as_fp8_data_with_block_scales(fp8_edge):
    hf_dir, _, out = fp8_edge
    cfg, params = load_checkpoint(out)
    assert cfg.weight_dtype == "fp8_g128"
    wk = params.layers[0].wk
    assert isinstance(wk, GroupQuantizedArray) and wk.data.dtype == jnp.float8_e4m3fn
    assert wk.data.shape == (1, 64, 192) and wk.scale.shape == (1, 64, 2)  # rows of a partial block, 2 col groups
    from safetensors import safe_open

    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
    down = params.layers[0].w_down
    assert s.shape == (2, 3) and down.scale.shape == (192, 3)
    np.testing.assert_array_equal(np.asarray(down.data).view(np.uint8), q.view(torch.uint8).numpy())  # as stored
    np.testing.assert_array_equal(np.asarray(down.scale)[127:129], s[[0, 1]].numpy())  # a block's rows share it
    np.testing.assert_array_equal(np.asarray(dequantize_grouped(down))[:, 300:],
                                  (q.float()[:, 300:] * s[:, 2:3].repeat_interleave(128, 0)[:192]).numpy())


def test_fp8_block_partial_edges_match_the_dequantized_model(fp8_edge):
    _, ref, out = fp8_edge
    ours = _our_logprobs(out)
    for s, ids in enumerate(PROMPTS):
        want = log_softmax(hf_logits(ref, ids))
        diff = np.abs(ours[s] - want).max()
        assert diff < 2e-4, (s, diff)


def test_fp8_block_matches_transformers_loading_the_checkpoint(tmp_path):
    """transformers reads fine-grained FP8 on CPU by dequantizing at load (whole blocks only)."""
    ref = fp8_block_checkpoint(make_hf_model(seed=5, **WHOLE), str(tmp_path / "hf"))
    tf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    convert(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="float32", progress=False)
    cfg, params = load_checkpoint(str(tmp_path / "out"))
    # The checkpoint's untied lm_head is float (not quantized): it stays float, as transformers keeps it.
    assert cfg.float_lm_head and not isinstance(params.lm_head, GroupQuantizedArray)
    assert isinstance(params.layers[0].wq, GroupQuantizedArray)
    ours = _our_logprobs(str(tmp_path / "out"))
    for s, ids in enumerate(PROMPTS):  # transformers reads the blocks as we do (it dequantizes to bf16)
        want = log_softmax(hf_logits(tf, ids))
        assert np.abs(log_softmax(hf_logits(ref, ids)) - want).max() < 5e-2
        assert np.abs(ours[s] - want).max() < 5e-2, s


def test_fp8_block_serves_the_dequantized_models_greedy_tokens(fp8_edge, tmp_path):
    hf_dir, ref, _ = fp8_edge
    assert_serves_greedy_tokens(hf_dir, ref, PROMPTS[:2], str(tmp_path / "cache" / "jax"), weight_dtype="fp8_g128")


@pytest.mark.parametrize("changes, words", [
    (dict(quant_method="bitsandbytes"), "quantization_config.quant_method 'bitsandbytes' is not supported"),
    (dict(weight_block_size=None), "quantization_config.weight_block_size None"),
    (dict(activation_scheme="static"), "quantization_config.activation_scheme 'static'"),
    (dict(fmt="e5m2"), "quantization_config.fmt 'e5m2'"),
])
def test_an_unsupported_method_or_variant_is_refused_naming_the_field(fp8_edge, tmp_path, changes, words):
    bad = edited_quantization_config(fp8_edge[0], str(tmp_path / "bad"), **changes)
    with pytest.raises(ConversionError, match=words.replace("(", r"\(").replace("[", r"\[")):
        convert(bad, str(tmp_path / "out"), dtype="float32", progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_a_block_size_the_scales_do_not_fit_is_refused(fp8_edge, tmp_path):
    bad = edited_quantization_config(fp8_edge[0], str(tmp_path / "bad"), weight_block_size=[64, 64])
    with pytest.raises(ConversionError, match=r"_scale_inv has shape \[2, 2\]; weight_block_size \[64, 64\] over \[192, 192\] implies \[3, 3\]"):
        convert(bad, str(tmp_path / "out"), dtype="float32", progress=False)
