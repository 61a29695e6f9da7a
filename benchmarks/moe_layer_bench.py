"""One mixture-of-experts layer: the grouped matmul (`model.moe.grouped_experts`, ragged_dot
over tokens sorted by expert) against the dense all-experts reference, same run.

    python benchmarks/moe_layer_bench.py [--out benchmarks/results/moe_layer_cpu.json] [--rounds 5]
    python benchmarks/moe_layer_bench.py --out DIR            # writes DIR/moe_layer_<platform>.json
    python benchmarks/moe_layer_bench.py --smoke --out DIR    # tiny shapes (CI)

Two expert shapes, both with the router's output as input (ids and weights from a softmax
over random logits): a Mixtral-like layer (8 experts, top 2) and a Qwen3-MoE-like one (64
experts, top 8), scaled to CPU sizes (on a GPU: Mixtral-8x7B's and Qwen3-30B-A3B's real
layer shapes in bf16). Token counts span decode batches (1, 8, 32) and prefill chunks (256,
1024). Decode-sized batches (tokens * k <= experts) also time `touched_experts`, the loop over
the touched experts that XLA CPU serves them with (`model.moe.serving_experts`; the record
names each case's serving path). Each path runs `--rounds` times and keeps its best time
(the machine may be shared); outputs are compared with the dense reference. The record also says whether the grouped path
lowers for CUDA (`.trace(...).lower(lowering_platforms=("cuda",))`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.moe import dense_experts, grouped_experts, route, serving_experts, touched_experts  # noqa: E402

# name: (experts, top k, hidden, expert ffw) per platform
SHAPES = {
    "cpu": {"mixtral-like": (8, 2, 512, 1024), "qwen3-moe-like": (64, 8, 512, 128)},
    "gpu": {"mixtral-8x7b layer": (8, 2, 4096, 14336), "qwen3-30b-a3b layer": (128, 8, 2048, 768)},
    "smoke": {"tiny": (4, 2, 32, 16)},
}
TOKENS = {"cpu": (1, 8, 32, 256, 1024), "gpu": (1, 8, 32, 256, 1024, 4096), "smoke": (1, 8)}


def inputs(t, e, k, h, f, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (t, h), jnp.float32).astype(dtype)
    cfg = LlamaConfig(vocab_size=8, hidden_size=h, intermediate_size=f, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, architecture="Qwen3MoeForCausalLM", num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
                      moe_router="softmax_topk")
    ids, weights = route(jax.random.normal(keys[1], (t, e)), cfg)
    w = [(jax.random.normal(kk, s, jnp.float32) / np.sqrt(s[-1])).astype(dtype)
         for kk, s in zip(keys[2:], ((e, f, h), (e, f, h), (e, h, f)))]
    return x, ids, weights, w


class _Cfg:
    def __init__(self, e, k):
        self.num_experts, self.num_experts_per_tok = e, k


def best_ms(fn, args, rounds):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3, out


def cuda_lowering_ok() -> str:
    x, ids, weights, w = inputs(8, 4, 2, 32, 16, jnp.float32)
    try:
        text = jax.jit(grouped_experts).trace(x, ids, weights, *w).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001  (recorded, not raised: the CPU numbers still stand)
        return f"failed: {type(e).__name__}: {e}"
    return "ok (ragged_dot in the module)" if "ragged_dot" in text else "ok"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="a .json file, or a directory for moe_layer_<platform>.json")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    p.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    args = p.parse_args(argv)
    platform = jax.default_backend()
    kind = "smoke" if args.smoke else ("gpu" if platform == "gpu" else "cpu")
    dtype = jnp.float32 if kind != "gpu" else jnp.bfloat16
    rounds = 1 if args.smoke else args.rounds
    grouped, dense, touched = jax.jit(grouped_experts), jax.jit(dense_experts), jax.jit(touched_experts)
    start, cases, ok = time.perf_counter(), [], True
    load_before = os.getloadavg()
    for name, (e, k, h, f) in SHAPES[kind].items():
        for t in TOKENS[kind]:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                break
            x, ids, weights, w = inputs(t, e, k, h, f, dtype, seed=t)
            a = (x, ids, weights, *w)
            g_ms, g_out = best_ms(grouped, a, rounds)
            d_ms, d_out = best_ms(dense, a, rounds)
            decode_sized = t * k <= e
            l_ms, l_out = best_ms(touched, a, rounds) if decode_sized else (None, d_out)
            diff = max(float(jnp.max(jnp.abs(g_out - d_out))), float(jnp.max(jnp.abs(l_out - d_out))))
            scale = float(jnp.max(jnp.abs(d_out)))
            good = diff <= (1e-4 if dtype == jnp.float32 else 3e-2) * max(scale, 1.0)
            ok &= good
            row = {"shape": name, "experts": e, "top_k": k, "hidden": h, "expert_ffw": f, "tokens": t,
                   "phase": "decode" if t <= 32 else "prefill", "grouped_ms": g_ms, "dense_ms": d_ms,
                   "dense_over_grouped": d_ms / g_ms, "touched_loop_ms": l_ms,
                   "dense_over_touched_loop": None if l_ms is None else d_ms / l_ms,
                   "serving_path": serving_experts(t, _Cfg(e, k)).__name__, "max_abs_diff": diff, "ok": good}
            cases.append(row)
            loop = "" if l_ms is None else f"  touched loop {l_ms:9.3f} ms ({d_ms / l_ms:6.2f}x)"
            print(f"{name:>20} T={t:>5}: grouped {g_ms:9.3f} ms  dense {d_ms:9.3f} ms  "
                  f"dense/grouped {d_ms / g_ms:6.2f}x{loop}  diff {diff:.2e}", flush=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
              "platform": platform, "devices": [str(d) for d in jax.devices()][:1], "cpus": os.cpu_count(),
              "dtype": jnp.dtype(dtype).name, "rounds": rounds, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "cuda_lowering": cuda_lowering_ok(), "ok": ok, "cases": cases}
    print("cuda lowering of the grouped path:", record["cuda_lowering"])
    if args.out:
        path = args.out
        if not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, f"moe_layer_{'smoke' if args.smoke else platform}.json")
        with open(path, "w") as fh:
            json.dump(record, fh, indent=2)
        print("wrote", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
