"""Trains the tiny byte-level models that ship with the project.

    python -m model.train --out_dir=model/default --steps=1500

Data recipe: every `.py` file of the running Python's standard library
(`sysconfig.get_paths()["stdlib"]`, sorted, test suites excluded), each as
BOS + UTF-8 bytes + EOS, concatenated and cut into windows. A file is held
out for evaluation when crc32(relative path) % 50 == 0, so the split is the
same on every machine. grain shuffles and batches the windows, optax runs
AdamW with warmup and cosine decay, orbax writes the result.

Training uses a dense causal forward over `[batch, seq]`; it shares every
layer function with the paged serving forward except attention itself, and a
test checks the two agree.
"""

from __future__ import annotations

import json
import os
import sysconfig
import time
import zlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging

from model.checkpoint import save_checkpoint
from model.config import LlamaConfig
from model.families import config_by_name
from model.layers import (apply_rope, head_projection, mlp_block, output_logits, output_projection, rms_norm,
                          rope_frequencies)
from model.params import Weights, init_params
from model.tokenizer import ByteTokenizer

HOLDOUT_MODULUS = 50


def stdlib_files() -> tuple[list[str], list[str]]:
    """(train, held-out) paths of the standard library's Python sources, deterministically split."""
    root = sysconfig.get_paths()["stdlib"]
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idle_test", "site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            (held if zlib.crc32(rel.encode()) % HOLDOUT_MODULUS == 0 else train).append(path)
    return train, held


def token_stream(paths: list[str], tokenizer: ByteTokenizer) -> np.ndarray:
    ids = []
    for path in paths:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        ids.extend(tokenizer.encode(text))
        ids.extend(tokenizer.eos_ids)
    return np.asarray(ids, np.int32)


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def dense_causal_attention(q, k, v, sm_scale):
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] -> [B, L, Hq, D], causal, GQA."""
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, length, hkv, hq // hkv, d)
    s = jnp.einsum("blkgd,bmkd->bkglm", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    mask = jnp.tril(jnp.ones((length, length), bool))
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkglm,bmkd->blkgd", p, v.astype(jnp.float32))
    return o.reshape(b, length, hq, d).astype(q.dtype)


def forward_dense(params: Weights, tokens, cfg: LlamaConfig):
    """Logits `[B, L, vocab]` for whole sequences starting at position 0 (training only)."""
    b, length = tokens.shape
    inv_freq = rope_frequencies(cfg)
    positions = jnp.arange(length, dtype=jnp.int32)
    x = params.embed[tokens].astype(cfg.jnp_dtype)
    for layer in params.layers:
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        # The serving forward's projections (2-D dots over [out, in] weights) on the flattened batch.
        tok = h.reshape(b * length, -1)
        q, k, v = (head_projection(tok, w).reshape(b, length, *w.shape[:2]) for w in (layer.wq, layer.wk, layer.wv))
        rope = jax.vmap(lambda t: apply_rope(t, positions, inv_freq))
        o = dense_causal_attention(rope(q), rope(k), v, cfg.head_dim**-0.5)
        x = x + output_projection(o.reshape(b * length, *o.shape[2:]), layer.wo).reshape(b, length, -1)
        x = jax.vmap(lambda t: mlp_block(layer, t, cfg))(x)
    return jax.vmap(lambda t: output_logits(params, t, cfg))(x)


def loss_fn(params, batch, cfg):
    logits = forward_dense(params, batch[:, :-1], cfg)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_optimizer(steps: int, peak_lr: float):
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, max(1, steps // 20), steps, peak_lr / 20)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.05))


def evaluate(params, data: np.ndarray, cfg: LlamaConfig, batch_size: int, max_batches: int = 20) -> float:
    loss = jax.jit(loss_fn, static_argnums=2)
    n = min(len(data) // batch_size, max_batches)
    return float(np.mean([loss(params, data[i * batch_size:(i + 1) * batch_size], cfg) for i in range(n)]))


def train(cfg: LlamaConfig, out_dir: str, steps: int, batch_size: int, seq_len: int, peak_lr: float,
          seed: int = 0, time_budget_s: float | None = None) -> dict:
    tokenizer = ByteTokenizer(cfg.vocab_size)
    train_paths, held_paths = stdlib_files()
    train_windows = windows(token_stream(train_paths, tokenizer), seq_len)
    held_windows = windows(token_stream(held_paths, tokenizer), seq_len)
    logging.info("data: %d train files (%d windows), %d held-out files (%d windows)",
                 len(train_paths), len(train_windows), len(held_paths), len(held_windows))

    dataset = (
        grain.MapDataset.source(train_windows)
        .shuffle(seed=seed)
        .repeat()
        .batch(batch_size, drop_remainder=True)
    )
    batches = iter(dataset.to_iter_dataset())

    params = init_params(cfg, jax.random.key(seed))
    optimizer = make_optimizer(steps, peak_lr)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.time()
    losses = []
    done = 0
    for done in range(1, steps + 1):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(next(batches)))
        if done % 25 == 0 or done == 1:
            losses.append((done, float(loss)))
            logging.info("step %d loss %.4f (%.1fs)", done, losses[-1][1], time.time() - start)
        if time_budget_s and time.time() - start > time_budget_s:
            logging.info("time budget reached at step %d", done)
            break
    elapsed = time.time() - start
    held_loss = evaluate(params, held_windows, cfg, batch_size)
    report = {
        "config": cfg.to_dict(),
        "steps": done,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens_seen": done * batch_size * seq_len,
        "train_seconds": round(elapsed, 1),
        "final_train_loss": losses[-1][1] if losses else None,
        "heldout_loss_nats_per_byte": round(held_loss, 4),
        "data": "CPython standard library .py sources (tests excluded), held out: crc32(path) % 50 == 0",
        "train_files": len(train_paths),
        "heldout_files": len(held_paths),
        "python": sysconfig.get_python_version(),
    }
    save_checkpoint(out_dir, params, cfg, storage_dtype=jnp.bfloat16)
    with open(os.path.join(out_dir, "train_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    logging.info("held-out loss %.4f nats/byte; saved to %s", held_loss, out_dir)
    return report


FLAGS = flags.FLAGS


def define_flags():
    """Flags are defined only when run as a program, so importing this module
    (the tests do) never clashes with another absl program's flags."""
    flags.DEFINE_string("config", "tiny", "Model shape: a name under configs/ or a JSON path.")
    flags.DEFINE_string("out_dir", "model/default", "Where to write the checkpoint.")
    flags.DEFINE_integer("steps", 1500, "Optimizer steps.")
    flags.DEFINE_integer("batch_size", 16, "Windows per step.")
    flags.DEFINE_integer("seq_len", 256, "Tokens per window.")
    flags.DEFINE_float("lr", 3e-3, "Peak learning rate.")
    flags.DEFINE_integer("seed", 0, "Initialisation and shuffling seed.")
    flags.DEFINE_float("time_budget_s", 0.0, "Stop early after this many seconds (0: no limit).")


def main(argv):
    del argv
    cfg = config_by_name(FLAGS.config)
    report = train(cfg, FLAGS.out_dir, FLAGS.steps, FLAGS.batch_size, FLAGS.seq_len, FLAGS.lr, FLAGS.seed,
                   FLAGS.time_budget_s or None)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main)
