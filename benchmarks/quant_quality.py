"""Quality and bytes of weight and KV-cache quantization on the embedded model.

    python benchmarks/quant_quality.py [--num_windows 128] [--out benchmarks/results]

Held-out data is the embedded model's own held-out split (`model.train`: the
standard library files with crc32(path) % 50 == 0, as BOS + bytes + EOS),
cut into 256-token windows exactly as training evaluated it. Every window is
run through the serving forward (`model.forward`, paged KV cache, reference
attention) as one prefill with logits at every position, so a quantized KV
cache is written and then read by attention for every prediction, as it is
when serving. Each variant is scored on the same windows:

  * loss (nats per byte = per token: the model is byte-level) and perplexity,
    and the difference to fp32;
  * top-1 agreement of the next-token prediction with fp32;
  * weight bytes (all weights) and the bytes a decode step streams (without
    the untied embedding, which this model does not have);
  * KV bytes per token (scales included) and the KV pool's capacity in tokens
    for a fixed byte budget (the engine's default CPU budget, 256 MiB);
  * the same byte counts for a Llama-3-8B shape (declarations only).

It also measures the scale granularity question on real K/V: the relative
RMS error of quantizing the fp32 model's cached K and V with one scale per
(token, KV head), as implemented, against one scale per (page, KV head)
chosen offline from the page's final contents (the best case of a per-page
scheme, which online would have to clip or rescale as the page fills).

Writes `OUT/quant_quality.json` and prints a Markdown table (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import quant  # noqa: E402
from model.cache import init_cache, pack_batch  # noqa: E402
from model.checkpoint import load_checkpoint  # noqa: E402
from model.families import config_by_name, kv_bytes_per_token  # noqa: E402
from model.forward import forward  # noqa: E402
from model.params import abstract_params  # noqa: E402
from model.quantize import quantize_params  # noqa: E402
from model.tokenizer import ByteTokenizer  # noqa: E402
from model.train import stdlib_files, token_stream, windows  # noqa: E402

SEQ_LEN, PAGE, BATCH = 256, 16, 8
POOL_BUDGET = 256 * 2**20  # EngineConfig.host_kv_cache_bytes
GPU_POOL_BUDGET = 40e9  # for the 8B rows: what an 80 GB GPU has left after bf16 weights and a reserve

# name -> (compute dtype, weight dtype, KV cache dtype)
VARIANTS = {
    "fp32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "int8 weights": ("float32", "int8", None),
    "fp8 weights": ("float32", "fp8", None),
    "int8 KV": ("float32", None, "int8"),
    "fp8 KV": ("float32", None, "fp8"),
    "int8 weights + int8 KV": ("float32", "int8", "int8"),
    "bf16, int8 weights + int8 KV": ("bfloat16", "int8", "int8"),
}

_forward = jax.jit(forward, static_argnames=("cfg", "backend"), donate_argnames=("cache",))


def heldout_windows(cfg, n: int) -> np.ndarray:
    stream = token_stream(stdlib_files()[1], ByteTokenizer(cfg.vocab_size))
    w = windows(stream, SEQ_LEN)  # [N, SEQ_LEN + 1]: inputs and next-byte targets
    idx = np.random.RandomState(0).permutation(len(w))[:n]
    return w[np.sort(idx)]


def variant(cfg, params, compute, weights):
    c = cfg.replace(dtype=compute)
    p = jax.tree.map(lambda x: x.astype(c.jnp_dtype), params)
    return quantize_params(p, c, weights) if weights else (c, p)


def run_windows(cfg, params, data, kv_dtype, keep_cache=False):
    """Per-position log-probs of the targets and argmax predictions over all windows."""
    pps = SEQ_LEN // PAGE
    losses, preds, caches = [], [], []
    for b in range(0, len(data), BATCH):
        chunk = data[b:b + BATCH]
        chunks = [(w[:-1].tolist(), 0, list(range(i * pps, (i + 1) * pps))) for i, w in enumerate(chunk)]
        tokens, md = pack_batch(chunks, page_size=PAGE, num_pages=BATCH * pps, num_tokens=BATCH * SEQ_LEN,
                                max_seqs=BATCH, pages_per_seq=pps, all_logits=True)
        cache = init_cache(cfg, BATCH * pps, PAGE, kv_dtype)
        logits, cache = _forward(params, cache, tokens, md, cfg=cfg, backend="reference")
        logp = jax.nn.log_softmax(logits[:len(chunk) * SEQ_LEN])
        targets = chunk[:, 1:].reshape(-1)
        losses.append(-np.asarray(jnp.take_along_axis(logp, targets[:, None], axis=1))[:, 0])
        preds.append(np.asarray(jnp.argmax(logp, axis=-1)))
        if keep_cache:
            caches.append((np.asarray(jnp.stack(cache.k)), np.asarray(jnp.stack(cache.v))))
    return np.concatenate(losses), np.concatenate(preds), caches


def granularity(caches) -> dict:
    """Relative RMS error of per-(token, head) vs ideal per-(page, head) scales on real K and V."""
    out = {}
    k = np.concatenate([c[0] for c in caches], axis=1)  # [layers, pages, page, heads, D]
    v = np.concatenate([c[1] for c in caches], axis=1)
    for fmt, dt in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
        for name, x in (("K", k), ("V", v)):
            out[f"{fmt} {name}"] = {
                "per_token_head": quant.numpy_quantize_error(x, dt, (4,)),
                "per_page_head": quant.numpy_quantize_error(x, dt, (2, 4)),
            }
    return out


def llama8b_bytes() -> dict:
    cfg = config_by_name("llama3-8b")
    rows = {}
    for name, (compute, weights, kv) in (("bf16", ("bfloat16", None, None)),
                                         ("int8 weights", ("bfloat16", "int8", None)),
                                         ("fp8 weights", ("bfloat16", "fp8", None)),
                                         ("int8 KV", ("bfloat16", None, "int8")),
                                         ("fp8 KV", ("bfloat16", None, "fp8"))):
        c = cfg.replace(dtype=compute, weight_dtype=weights)
        abstract = abstract_params(c)
        kv_dtype = quant.kv_cache_dtype(c, kv)
        per_token = kv_bytes_per_token(c, kv_dtype)
        rows[name] = {"weight_bytes": quant.streamed_weight_bytes(abstract, c)
                      + int(np.prod(abstract.embed.shape)) * abstract.embed.dtype.itemsize,
                      "streamed_weight_bytes": quant.streamed_weight_bytes(abstract, c),
                      "kv_bytes_per_token": per_token, "kv_pool_tokens_40GB": int(GPU_POOL_BUDGET // per_token)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num_windows", type=int, default=128, help="held-out windows of 256 bytes per variant")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--checkpoint", default=None, help="default: the embedded model")
    ap.add_argument("--table_from", metavar="JSON", default=None, help="only print the table of a results file")
    args = ap.parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            print(markdown(json.load(f)))
        return 0

    from serving.llm import default_checkpoint_dir

    cfg, params = load_checkpoint(args.checkpoint or default_checkpoint_dir())
    data = heldout_windows(cfg, args.num_windows)
    print(f"held-out: {len(data)} windows x {SEQ_LEN} bytes = {len(data) * SEQ_LEN} predictions", flush=True)
    results, ref_preds, ref_caches, ref_losses = {}, None, None, None
    for name, (compute, weights, kv) in VARIANTS.items():
        t0 = time.perf_counter()
        c, p = variant(cfg, params, compute, weights)
        kv_dtype = quant.kv_cache_dtype(c, kv)
        losses, preds, caches = run_windows(c, p, data, kv_dtype, keep_cache=name == "fp32")
        if name == "fp32":
            ref_preds, ref_caches, ref_losses = preds, caches, losses
        per_token = kv_bytes_per_token(c, kv_dtype)
        loss = float(np.mean(losses))
        results[name] = {
            "compute_dtype": compute, "weight_dtype": weights or compute, "kv_cache_dtype": str(jnp.dtype(kv_dtype)),
            "loss_nats_per_byte": loss, "perplexity": float(np.exp(loss)),
            "loss_stderr": float(np.std(losses) / np.sqrt(len(losses))),
            # Paired over the same predictions: the noise of the delta, not of the data.
            "loss_delta_stderr": float(np.std(losses - ref_losses) / np.sqrt(len(losses))),
            "top1_agreement_with_fp32": float(np.mean(preds == ref_preds)),
            "weight_bytes": int(sum(x.nbytes for x in jax.tree.leaves(p))),
            "streamed_weight_bytes": quant.streamed_weight_bytes(p, c),
            "kv_bytes_per_token": per_token, "kv_pool_tokens": int(POOL_BUDGET // per_token),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        r = results[name]
        print(f"{name:<30} loss {loss:.4f} ppl {r['perplexity']:.4f} agree {r['top1_agreement_with_fp32']:.4f} "
              f"({r['seconds']} s)", flush=True)
    base = results["fp32"]["loss_nats_per_byte"]
    for r in results.values():
        r["loss_delta_vs_fp32"] = r["loss_nats_per_byte"] - base
    report = {
        "model": "embedded byte model (model/default)", "config": cfg.to_dict(),
        "data": f"held-out split of model.train, {len(data)} windows of {SEQ_LEN} bytes, seed 0",
        "forward": "model.forward (paged KV, reference attention), one prefill per window, all-position logits",
        "kv_pool_budget_bytes": POOL_BUDGET, "variants": results,
        "kv_scale_granularity_rel_rms_error": granularity(ref_caches),
        "llama3_8b_bytes": llama8b_bytes(), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "quant_quality.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(markdown(report))
    print(f"wrote {path}")
    return 0


def markdown(r: dict) -> str:
    v = r["variants"]
    lines = ["| variant | loss (nats/byte) | vs fp32, millinats/byte (± paired s.e.) | perplexity | top-1 = fp32 | weight bytes | streamed / step "
             "| KV bytes/token | KV pool tokens (256 MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, x in v.items():
        lines.append(f"| {name} | {x['loss_nats_per_byte']:.4f} | {x['loss_delta_vs_fp32'] * 1e3:+.2f} "
                     f"± {x['loss_delta_stderr'] * 1e3:.2f} | "
                     f"{x['perplexity']:.4f} | {x['top1_agreement_with_fp32']:.2%} | {x['weight_bytes'] / 1e6:.2f} MB "
                     f"| {x['streamed_weight_bytes'] / 1e6:.2f} MB | {x['kv_bytes_per_token']:,} | "
                     f"{x['kv_pool_tokens']:,} |")
    lines += ["", "| KV scale granularity (rel. RMS error) | per token and head | per page and head (ideal) |",
              "|---|---|---|"]
    for name, x in r["kv_scale_granularity_rel_rms_error"].items():
        lines.append(f"| {name} | {x['per_token_head']:.4f} | {x['per_page_head']:.4f} |")
    lines += ["", "| Llama-3-8B shape | weight bytes | streamed / decode step | KV bytes/token | KV tokens in 40 GB |",
              "|---|---|---|---|---|"]
    for name, x in r["llama3_8b_bytes"].items():
        lines.append(f"| {name} | {x['weight_bytes'] / 1e9:.2f} GB | {x['streamed_weight_bytes'] / 1e9:.2f} GB | "
                     f"{x['kv_bytes_per_token']:,} | {x['kv_pool_tokens_40GB']:,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
