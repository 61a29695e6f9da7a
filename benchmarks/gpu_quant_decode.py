"""Batch-1 decode of a Llama-3-8B-shaped model: int8 / fp8 / block-scaled fp8 weights against bf16, on one GPU.

    python benchmarks/gpu_quant_decode.py [--out DIR] [--context 1024] [--steps 30] [--rounds 3]
    python benchmarks/gpu_quant_decode.py --smoke     # CPU: tiny shapes, a few steps

At batch 1 a decode step streams every weight once and does ~2 FLOPs per
weight byte: it is memory-bound, so its ceiling is bandwidth / bytes per step.
int8 / fp8 weights (model.quant: one byte per weight, fp32 per-channel scales,
widened to bf16 inside the matmul) halve the weight bytes, so the step time
should roughly halve; the issue's claim to check is "the ceiling roughly
doubles". `fp8_g128` is the block-scaled kind of the published FP8 checkpoints
(one scale per output row and 128 inputs), whose projections the Pallas backend
runs in `kernels_pallas.grouped_matmul` (the tile widened and scaled in
registers) instead of XLA's widened operand. Weights are random (quality is measured on the embedded model by
`quant_quality.py`); the KV cache holds a short context (default 1K tokens,
134 MB in bf16, ~1% of the weights) so the comparison is about the weights.

Each variant is the same jitted `model.forward_jit` decode step (one token,
one sequence, cache donated, attention backend "auto": the Pallas kernel on
GPU), timed over `--steps` steps after a warm-up, in alternating rounds
(bf16, int8, fp8, bf16, ...) keeping each variant's best round. Reported per
variant: ms per step, tokens/s, bytes streamed per step (weights without the
embedding table, plus the KV read) and achieved bandwidth, and the speedup
over bf16. The bf16 params are built on the device (random normal, jitted)
and quantized on the device; peak memory ~33 GB.

Writes OUT/gpu_quant_decode.json (gpu_quant_decode_smoke.json with --smoke).
Exit status 0 when every variant ran and produced finite logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import quant  # noqa: E402
from model.cache import init_cache, pack_batch  # noqa: E402
from model.families import config_by_name, kv_bytes_per_token, num_params  # noqa: E402
from model.forward import forward_jit  # noqa: E402
from model.params import init_params  # noqa: E402
from model.quantize import quantize_params  # noqa: E402

PAGE = 16


def decode_inputs(context: int):
    """One sequence with `context - 1` cached tokens decoding its next one."""
    pages = -(-context // PAGE)
    tokens, md = pack_batch([([7], context - 1, list(range(pages)))], page_size=PAGE, num_pages=pages,
                            num_tokens=1, max_seqs=1, pages_per_seq=pages)
    return pages, jnp.asarray(tokens), jax.tree.map(jnp.asarray, md)


def time_steps(params, cache, tokens, md, cfg, backend, steps):
    """(best-of-steps median seconds per step, final cache, last logits)."""
    times = []
    logits = None
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, cache = forward_jit(params, cache, tokens, md, cfg, backend)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), cache, logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--model", default=None, help="config name (default llama3-8b; tiny with --smoke)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens of the one sequence")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds; each variant keeps its best")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--variants", default="bf16,int8,fp8,fp8_g128")
    ap.add_argument("--budget-s", type=float, default=180.0,
                    help="stop compiling further variants after this many seconds (the rest are reported skipped)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    smoke = args.smoke
    model = args.model or ("tiny" if smoke else "llama3-8b")
    context = args.context or (64 if smoke else 1024)
    steps = args.steps or (3 if smoke else 30)
    rounds = args.rounds or (1 if smoke else 3)
    backend = "reference" if smoke and args.backend == "auto" else args.backend
    cfg = config_by_name(model).replace(dtype="bfloat16")
    print(f"gpu_quant_decode: {model} ({num_params(cfg) / 1e9:.2f}B params), batch 1, context {context}, "
          f"{steps} steps x {rounds} rounds, backend {backend}, device {jax.devices()[0].device_kind}", flush=True)

    t0 = time.perf_counter()
    base = init_params(cfg, jax.random.key(0))
    jax.block_until_ready(base)
    variants = {}
    for name in args.variants.split(","):
        if name == "bf16":
            variants[name] = (cfg, base)
        else:
            qcfg, qparams = quantize_params(base, cfg, name)
            jax.block_until_ready(qparams)
            variants[name] = (qcfg, qparams)
    print(f"params built and quantized in {time.perf_counter() - t0:.1f} s", flush=True)

    pages, tokens, md = decode_inputs(context)
    kv_read = context * kv_bytes_per_token(cfg)
    caches, best, logits_of, compile_s, skipped = {}, {}, {}, {}, []
    for name, (c, p) in list(variants.items()):  # compile and warm up each variant once
        if time.perf_counter() - start > args.budget_s:
            skipped.append(name)
            del variants[name]
            continue
        t0 = time.perf_counter()
        cache = init_cache(c, pages, PAGE)
        logits, caches[name] = forward_jit(p, cache, tokens, md, c, backend)
        logits.block_until_ready()
        compile_s[name] = round(time.perf_counter() - t0, 1)
    for _ in range(rounds):
        for name, (c, p) in variants.items():
            sec, caches[name], logits_of[name] = time_steps(p, caches[name], tokens, md, c, backend, steps)
            best[name] = min(best.get(name, float("inf")), sec)

    ok = True
    rows = {}
    for name, (c, p) in variants.items():
        finite = bool(np.isfinite(np.asarray(logits_of[name], np.float32)).all())
        ok &= finite
        streamed = quant.streamed_weight_bytes(p, c)
        sec = best[name]
        rows[name] = {"seconds_per_step": sec, "tokens_per_s": 1.0 / sec, "streamed_weight_bytes": streamed,
                      "kv_bytes_read": kv_read, "achieved_bandwidth_gbs": (streamed + kv_read) / sec / 1e9,
                      "compile_and_first_step_s": compile_s[name], "finite_logits": finite}
    ref = rows.get("bf16")
    for r in rows.values():
        if ref:
            r["speedup_vs_bf16"] = ref["seconds_per_step"] / r["seconds_per_step"]
            r["byte_ratio_vs_bf16"] = ((ref["streamed_weight_bytes"] + kv_read)
                                       / (r["streamed_weight_bytes"] + kv_read))

    print(f"{'weights':<8} {'ms/step':>9} {'tok/s':>9} {'GB/step':>9} {'GB/s':>9} {'speedup':>8} {'bytes x':>8}")
    for name, r in rows.items():
        print(f"{name:<8} {r['seconds_per_step'] * 1e3:>9.3f} {r['tokens_per_s']:>9.1f} "
              f"{(r['streamed_weight_bytes'] + kv_read) / 1e9:>9.3f} {r['achieved_bandwidth_gbs']:>9.1f} "
              f"{r.get('speedup_vs_bf16', float('nan')):>8.2f} {r.get('byte_ratio_vs_bf16', float('nan')):>8.2f}")
    result = {"model": model, "batch": 1, "context": context, "steps": steps, "rounds": rounds, "backend": backend,
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "smoke": smoke, "variants": rows,
              "skipped_over_budget": skipped, "ok": ok}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_quant_decode{'_smoke' if smoke else ''}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    if skipped:
        print(f"skipped (over the {args.budget_s:.0f} s budget): {', '.join(skipped)}")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
