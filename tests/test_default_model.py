"""The embedded default model ships in the repo and has actually learned its data."""

import json
import os

import jax.numpy as jnp
import numpy as np

from model.checkpoint import load_checkpoint
from model.tokenizer import ByteTokenizer
from model.train import loss_fn, stdlib_files, token_stream, windows

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model", "default")


def test_default_checkpoint_is_small_and_documented():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(DEFAULT_DIR) for f in fs)
    assert total < 16 * 2**20, f"embedded model is {total / 2**20:.1f} MiB"
    report = json.load(open(os.path.join(DEFAULT_DIR, "train_report.json")))
    readme = open(os.path.join(os.path.dirname(DEFAULT_DIR), "..", "README.md")).read()
    assert f"{report['heldout_loss_nats_per_byte']:.2f}" in readme


def test_default_model_beats_uniform_by_far_on_held_out_text():
    cfg, params = load_checkpoint(DEFAULT_DIR)
    tok = ByteTokenizer(cfg.vocab_size)
    _, held = stdlib_files()
    data = windows(token_stream(held[:4], tok), 128)[:8]
    loss = float(loss_fn(params, jnp.asarray(data), cfg))
    uniform = float(np.log(cfg.vocab_size))
    # A byte model that learned Python source is far below uniform (5.77 nats).
    assert loss < 0.4 * uniform, loss
