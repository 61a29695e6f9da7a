"""The adapter delta of one projection, two ways: dense over every slot (what `model.linear.lora_delta` does)
against a per-token gather of each token's own A and B (Punica's BGMV), next to the base product.

    python benchmarks/lora_delta_bench.py [--out benchmarks/results/lora_delta_cpu.json]

Each form is one jitted function, timed as the best of 5 runs of 200 calls, for decode- and prefill-sized
steps and the embedded model's projection shapes (4 slots of rank 16, tokens spread over the slots).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model.linear import LoraWeight, lora_delta  # noqa: E402

SLOTS, RANK = 4, 16


def dense(x, a, b, slot):
    return lora_delta(x, LoraWeight(None, a, b, slot, RANK))


def gather(x, a, b, slot):
    """Each token's own A [rank, in] and B [out, rank], gathered, then batched matrix-vector products."""
    s = jnp.maximum(slot, 0)
    a3, b3 = a.reshape(SLOTS, RANK, -1), b.reshape(b.shape[0], SLOTS, RANK).transpose(1, 0, 2)
    h = jnp.einsum("ti,tri->tr", x, a3[s]) * (slot >= 0)[:, None]
    return jnp.einsum("tr,tor->to", h, b3[s])


def base(x, w):
    return x @ w.T


def best_us(f, args) -> float:
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200):
            y = f(*args)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t) / 200)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/lora_delta_cpu.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = []
    for tokens in (16, 64, 256):
        for d_in, d_out in ((256, 256), (256, 768), (768, 256)):
            x = jnp.asarray(rng.normal(size=(tokens, d_in)), jnp.float32)
            a = jnp.asarray(rng.normal(size=(SLOTS * RANK, d_in)), jnp.float32)
            b = jnp.asarray(rng.normal(size=(d_out, SLOTS * RANK)), jnp.float32)
            w = jnp.asarray(rng.normal(size=(d_out, d_in)), jnp.float32)
            slot = jnp.asarray(np.arange(tokens) % SLOTS, jnp.int32)
            d, g = jax.jit(dense), jax.jit(gather)
            np.testing.assert_allclose(np.asarray(d(x, a, b, slot)), np.asarray(g(x, a, b, slot)), rtol=1e-3, atol=1e-2)
            row = {"tokens": tokens, "in": d_in, "out": d_out, "base_us": best_us(jax.jit(base), (x, w)),
                   "dense_us": best_us(d, (x, a, b, slot)), "gather_us": best_us(g, (x, a, b, slot))}
            row["gather_over_dense"] = row["gather_us"] / row["dense_us"]
            row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
            print(row, flush=True)
            cases.append(row)
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "platform": jax.default_backend(), "load_avg_before": os.getloadavg(), "slots": SLOTS, "rank": RANK,
              "cases": cases}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
