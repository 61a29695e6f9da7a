"""One layer's paged attention on CPU: the "xla" backend against the reference, same run.

    python benchmarks/attention_cpu_bench.py [--out benchmarks/results/attention_cpu.json] [--rounds 7]
        [--baseline_rev GIT_REV]

Shapes of the 125M model of benchmarks/offline_throughput.py (12 query heads
over 4 KV heads, head_dim 64, fp32, 16-token pages) in the batches its mixed
workload produces: decode batches, whole prompts, a prefill chunk over a long
context, and a prefill chunk sharing the step with decodes. Both backends
alternate for `--rounds` rounds and each keeps its best time (the machine is
shared), the order rotating from round to round (a backend run right after
another finds the same K/V in cache); outputs are checked against each
other first. `--baseline_rev`
adds the xla backend as it was at that git revision (its
kernels_pallas/xla_attention.py, loaded beside the current one) to the
same rounds, for a before/after in one run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.reference import ragged_paged_attention_reference  # noqa: E402
from kernels_pallas.xla_attention import ragged_paged_attention_xla, rows_per_item  # noqa: E402

PAGE, KV_HEADS, GROUP, HEAD_DIM = 16, 4, 3, 64

# name: ([(q_len, kv_len)], T, S, P) with T, S, P the step's padded bucket.
CASES = {
    "decode 1 seq, ctx 40": ([(1, 40)], 1, 1, 4),
    "decode 32 seqs, ctx 219-250": ([(1, 250 - i) for i in range(32)], 32, 32, 16),
    "decode 32 seqs, ctx 469-500": ([(1, 500 - i) for i in range(32)], 32, 32, 32),
    # Contexts spread over the bucket, as in a running batch of mixed requests.
    "decode 32 seqs, ctx 30-500": ([(1, 30 + (i * 151) % 471) for i in range(32)], 32, 32, 32),
    "decode 17 seqs in a 32 bucket, ctx 200-500": ([(1, 200 + (i * 97) % 301) for i in range(17)], 32, 32, 32),
    "prefill 2 prompts of 256": ([(256, 256)] * 2, 512, 32, 16),
    "prefill chunk of 512 over ctx 1000": ([(512, 1000)], 512, 32, 64),
    "prefill chunk 225 + 31 decodes ctx 300": ([(225, 225)] + [(1, 300)] * 31, 256, 32, 32),
    # The decode buckets of the mixed workload (16 and 32 rows, contexts 16-512), batch-1 decode,
    # and a mixed step whose decodes' contexts spread over the bucket.
    "decode 32 seqs, ctx 16-512": ([(1, 16 + (i * 151) % 497) for i in range(32)], 32, 32, 32),
    "decode 16 seqs, ctx 16-512": ([(1, 16 + (i * 151) % 497) for i in range(16)], 16, 32, 32),
    "decode 16 seqs, ctx 16-256": ([(1, 16 + (i * 71) % 241) for i in range(16)], 16, 32, 16),
    "decode 4 seqs, ctx 100-250": ([(1, 100 + 50 * i) for i in range(4)], 4, 4, 16),
    "decode 1 seq, ctx 500": ([(1, 500)], 1, 1, 32),
    "prefill chunk 128 + 15 decodes ctx 16-500": ([(128, 400)] + [(1, 16 + (i * 151) % 485) for i in range(15)],
                                                  256, 32, 32),
}


def baseline_attention(rev):
    """`ragged_paged_attention_xla` as it was at git revision `rev`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{rev}:kernels_pallas/xla_attention.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "xla_attention_baseline.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("xla_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ragged_paged_attention_xla


def best_of_rotating_rounds(runs: dict, rounds: int) -> dict:
    """name -> the best wall time (s) of `runs[name]()` over `rounds` rounds in which every run goes once.
    The order rotates from round to round: none always runs first, or right after the same other one
    (whose data it would find in cache)."""
    best = {name: float("inf") for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def batch(seqs, T, S, P, rng):
    num_pages = S * P + 4
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    k, v = normal(num_pages, PAGE, KV_HEADS, HEAD_DIM), normal(num_pages, PAGE, KV_HEADS, HEAD_DIM)
    q = normal(T, KV_HEADS * GROUP, HEAD_DIM)
    pool = rng.permutation(num_pages)
    tables = np.zeros((S, P), np.int32)
    cu = np.zeros(S + 1, np.int32)
    kv_lens = np.zeros(S, np.int32)
    for i, (ql, kl) in enumerate(seqs):
        tables[i] = pool[i * P:(i + 1) * P]
        cu[i + 1:] = cu[i] + ql
        kv_lens[i] = kl
    return q, k, v, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "attention_cpu.json"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline_rev", default=None,
                    help="also time the xla backend of this git revision, same rounds (before/after)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    fns = {"reference": jax.jit(ragged_paged_attention_reference), "xla": jax.jit(ragged_paged_attention_xla)}
    if args.baseline_rev:
        fns["baseline"] = jax.jit(baseline_attention(args.baseline_rev))
    rows = []
    load_before = os.getloadavg()
    for name, (seqs, T, S, P) in CASES.items():
        args_ = batch(seqs, T, S, P, rng)
        outs = {k: f(*args_).block_until_ready() for k, f in fns.items()}
        err = float(jnp.abs(outs["xla"] - outs["reference"]).max())
        best = best_of_rotating_rounds({k: (lambda f=f: f(*args_).block_until_ready()) for k, f in fns.items()},
                                       args.rounds)
        row = {"case": name, "T": T, "S": S, "P": P, "rows_per_item": rows_per_item(T, S),
               "reference_ms": best["reference"] * 1e3, "xla_ms": best["xla"] * 1e3,
               "speedup": best["reference"] / best["xla"], "max_abs_diff": err}
        line = (f"{name:42s} reference {row['reference_ms']:8.2f} ms   xla {row['xla_ms']:8.2f} ms   "
                f"x{row['speedup']:.1f}   (max |diff| {err:.1e})")
        if "baseline" in fns:
            row["baseline_ms"] = best["baseline"] * 1e3
            row["xla_vs_baseline"] = best["baseline"] / best["xla"]
            row["baseline_max_abs_diff"] = float(jnp.abs(outs["baseline"] - outs["reference"]).max())
            line += f"   baseline {row['baseline_ms']:8.2f} ms (xla x{row['xla_vs_baseline']:.2f})"
        rows.append(row)
        print(line, flush=True)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
              "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "rounds": args.rounds, "baseline_rev": args.baseline_rev,
              "command": " ".join(["python"] + sys.argv), "cases": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
