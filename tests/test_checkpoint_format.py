"""Checkpoint format numbers: a format-1 ([in, out]) checkpoint is refused with a clear error,
and `model.upgrade_checkpoint` turns it into the same weights in format 2 ([out, in])."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import tiny_config
from model.cache import init_cache, pack_batch
from model.checkpoint import (CONFIG_FILE, FORMAT_KEY, FORMAT_VERSION, PARAMS_DIR, CheckpointFormatError,
                              load_checkpoint, save_checkpoint)
from model.forward import forward
from model.params import abstract_params, flatten_params, init_params
from model.quantize import quantize_params
from model.upgrade_checkpoint import main as upgrade_main
from model.upgrade_checkpoint import upgrade

# Every weight square in both layouts (embed = heads = head_dim = ffw = vocab = 4): shapes alone cannot
# tell the layouts apart, only the format number can.
SQUARE = tiny_config(vocab_size=4, hidden_size=4, intermediate_size=4, num_heads=4, num_kv_heads=4, head_dim=4,
                     num_layers=2, tie_word_embeddings=False, bos_token_id=0, eos_token_ids=(1,))

# How format 1 stored each linear weight, written out from the format-2 array (independently of the
# upgrade's own table): wq/wk/wv [embed, heads, head_dim], wo [q_heads, head_dim, embed], matrices [in, out].
TO_FORMAT_1 = {"wq": (2, 0, 1), "wk": (2, 0, 1), "wv": (2, 0, 1), "wo": (1, 2, 0),
               "w_gate": (1, 0), "w_up": (1, 0), "w_down": (1, 0), "lm_head": (1, 0)}


def save_format_1(directory, params, cfg, storage_dtype=None):
    """A checkpoint as written before format numbers existed: [in, out] weights, no metadata."""
    flat = {}
    for name, w in flatten_params(params).items():
        w = np.asarray(w)
        parts = name.split(".")
        base = parts[-2] if parts[-1] in ("data", "scale") else parts[-1]
        if base in TO_FORMAT_1 and parts[-1] != "scale":
            w = np.ascontiguousarray(w.transpose(TO_FORMAT_1[base]))
        if storage_dtype is not None and w.dtype == np.float32 and parts[-1] != "scale":
            w = w.astype(storage_dtype)
        flat[name] = w
    os.makedirs(directory, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(directory, PARAMS_DIR), flat, force=True)
        ckptr.wait_until_finished()
    cfg.save(os.path.join(directory, CONFIG_FILE))


def logits(cfg, params):
    cache = init_cache(cfg, 4, 4)
    tokens, md = pack_batch([([0, 2, 3, 1, 2], 0, [0, 1])], page_size=4, num_pages=4, num_tokens=8, max_seqs=2,
                            pages_per_seq=2, logits_rows=8, all_logits=True)
    return np.asarray(jax.jit(forward, static_argnames=("cfg", "backend"))(params, cache, tokens, md, cfg,
                                                                          "reference")[0])


def test_format_1_is_refused_even_when_every_shape_matches(tmp_path):
    params = init_params(SQUARE, jax.random.key(0))
    directory = str(tmp_path / "old")
    save_format_1(directory, params, SQUARE)
    with ocp.StandardCheckpointer() as ckptr:  # the risk is real: a shape check alone would pass
        stored = ckptr.metadata(os.path.join(directory, PARAMS_DIR)).item_metadata
    stored = getattr(stored, "tree", stored)
    assert {k: tuple(v.shape) for k, v in stored.items()} == {
        k: v.shape for k, v in flatten_params(abstract_params(SQUARE)).items()}
    with pytest.raises(CheckpointFormatError, match=r"format 1 \(linear weights \[in, out\]\).*"
                                                    r"python -m model.upgrade_checkpoint --dir="):
        load_checkpoint(directory)

    assert upgrade(directory) == 2 * 7 + 1  # seven linear weights per layer, and the head
    _, restored = load_checkpoint(directory)
    for name, w in flatten_params(params).items():
        np.testing.assert_array_equal(np.asarray(flatten_params(restored)[name]), np.asarray(w), err_msg=name)
    np.testing.assert_array_equal(logits(SQUARE, restored), logits(SQUARE, params))
    assert not os.path.exists(directory + ".upgrading")


def test_quantized_bf16_checkpoint_upgrades_to_another_directory_keeping_dtypes(tmp_path):
    cfg = tiny_config(tie_word_embeddings=False)
    qcfg, qparams = quantize_params(init_params(cfg, jax.random.key(1)), cfg, "int8")
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    save_format_1(old, qparams, qcfg, storage_dtype=jnp.bfloat16)
    with open(os.path.join(old, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0"}')
    with pytest.raises(CheckpointFormatError, match="format 1"):
        load_checkpoint(old)
    assert upgrade_main([f"--dir={old}", f"--out_dir={new}"]) == 0
    with open(os.path.join(new, "tokenizer.json")) as f:
        assert f.read() == '{"version": "1.0"}'
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(os.path.join(new, PARAMS_DIR))
    assert meta.custom_metadata[FORMAT_KEY] == FORMAT_VERSION
    tree = getattr(meta.item_metadata, "tree", meta.item_metadata)
    assert tree["layers.0.wq.data"].dtype == jnp.int8 and tree["layers.0.wq.scale"].dtype == jnp.float32
    assert tree["layers.0.attn_norm"].dtype == jnp.bfloat16  # stored dtypes kept, nothing re-rounded
    got_cfg, got = load_checkpoint(new)
    assert got_cfg == qcfg
    for name, w in flatten_params(qparams).items():
        want = np.asarray(w, np.float32)
        if not name.endswith((".data", ".scale")):
            want = want.astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(flatten_params(got)[name], np.float32), want, err_msg=name)
    assert upgrade_main([f"--dir={new}"]) == 0  # already format 2: nothing to do
    with pytest.raises(CheckpointFormatError, match="format 1"):
        load_checkpoint(old)  # the source is left as it was


def test_a_newer_format_is_refused(tmp_path):
    cfg = tiny_config()
    save_checkpoint(str(tmp_path), init_params(cfg, jax.random.key(2)), cfg)
    with ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(os.path.join(str(tmp_path), PARAMS_DIR))
        ckptr.save(os.path.join(str(tmp_path), PARAMS_DIR), flat, force=True,
                   custom_metadata={FORMAT_KEY: FORMAT_VERSION + 1})
        ckptr.wait_until_finished()
    with pytest.raises(CheckpointFormatError, match="newer"):
        load_checkpoint(str(tmp_path))
    assert upgrade_main([f"--dir={tmp_path}"]) == 1
