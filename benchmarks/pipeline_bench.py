"""Pipeline parallelism: step time against the number of microbatches, and the measured idle
fraction next to the bubble formula (p - 1) / (m + p - 1).

    python benchmarks/pipeline_bench.py                     # p = 2 and 4, m = 1..16, CPU devices
    python benchmarks/pipeline_bench.py --ps 2 --ms 1,4 --rounds 3 --out /tmp/pp.json

One forward step of a fixed mixed batch (prefill chunks of several sequences, one token
bucket) runs through `sharding.pipeline.pipeline_forward` for each (p, m), with tensor
parallelism 1 inside each stage, on `p` devices.

How the idle fraction is measured. Stages are SPMD: every stage runs every one of the
`m + p - 1` ticks, and in the `p - 1` fill/drain ticks where it has no microbatch it computes
on stale data with its KV writes dropped. A stage's idle time is therefore exactly the time of
those extra ticks. The benchmark compiles the same step a second time with only `m` ticks
(`num_ticks=m`: the same per-tick work, the same embedding, logits and metadata, but no
fill/drain; its results are wrong and only its time is used) and reports

    idle = (t(m + p - 1 ticks) - t(m ticks)) / t(m + p - 1 ticks)

with `t` the wall time of a step, and again with `t` the CPU time the process spent on it (all
of XLA's threads): on a shared machine the CPU time is far less disturbed by other processes,
and with every stage computing through every tick the two ratios agree when nothing else runs.

It equals (p - 1)/(m + p - 1) when a tick's cost is constant and the work outside the loop is
negligible; per-step fixed costs (embedding, logits, the tick loop's bookkeeping) pull it below
the formula, and anything that makes later ticks dearer pulls it above. Both programs are timed
in alternating rounds and each keeps its best time (the machine may be shared).

On CPU the "devices" are threads of one process sharing the host's cores, so stages do not
really run concurrently and absolute step times say little about a GPU pipeline; the ratio of
the two programs does measure what the bubble costs. A single-device step (the plain forward,
all layers) is timed as the reference.
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
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.cache import init_cache, pack_batch  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.forward import forward_jit  # noqa: E402
from model.params import init_params  # noqa: E402
from sharding.pipeline import make_pipeline_layout, pipeline_forward_jit  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline_bench_cpu.json")


def model_config(layers: int, hidden: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                       num_heads=8, num_kv_heads=4, head_dim=hidden // 8, rope_theta=10000.0, dtype="float32",
                       max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,))


def batch(tokens: int, seqs: int, page_size: int, num_pages: int):
    """`seqs` prefill chunks sharing `tokens` tokens, each at a different cached length."""
    rng = np.random.default_rng(0)
    per_seq = tokens // seqs
    pages_per_seq = num_pages // seqs
    chunks = []
    for i in range(seqs):
        start = 16 * i
        table = list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
        chunks.append((rng.integers(3, 512, per_seq), start, table))
    return pack_batch(chunks, page_size=page_size, num_pages=num_pages, num_tokens=tokens, max_seqs=seqs,
                      pages_per_seq=pages_per_seq, logits_rows=seqs)


class Contender:
    """One compiled step and its device state, timed call by call."""

    def __init__(self, fn, params, cache, tokens, md):
        self.fn, self.params, self.cache = fn, params, cache
        self.tokens, self.md = tokens, md
        self.best = self.best_cpu = float("inf")
        self.call()  # compile and run once

    def call(self):
        logits, self.cache = self.fn(self.params, self.cache, self.tokens, self.md)
        jax.block_until_ready(logits)

    def time(self, repeats: int):
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            self.call()
            self.best = min(self.best, time.perf_counter() - t0)
            self.best_cpu = min(self.best_cpu, time.process_time() - c0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps", default="2,4", help="pipeline sizes")
    ap.add_argument("--ms", default="1,2,4,8,16", help="microbatch counts")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="tokens in the step")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per contender per round")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    ps = [int(x) for x in args.ps.split(",")]
    ms = [int(x) for x in args.ms.split(",")]

    cfg = model_config(args.layers, args.hidden)
    page_size, num_pages = 16, 16 * args.seqs
    params = init_params(cfg, jax.random.key(0))
    tokens, md = batch(args.tokens, args.seqs, page_size, num_pages)
    dev0 = jax.devices()[0]
    single = Contender(lambda p, c, t, m: forward_jit(p, c, t, m, cfg, "reference"),
                       jax.device_put(params, dev0), jax.device_put(init_cache(cfg, num_pages, page_size), dev0),
                       tokens, md)
    rows = []
    for p in ps:
        for m in ms:
            layout = make_pipeline_layout(p, 1, m)
            staged = layout.stage_params(cfg, params)
            tok, md_rep = jax.device_put((tokens, md), layout.replicated)

            def make(ticks, layout=layout, staged=staged, tok=tok, md_rep=md_rep):
                fn = lambda pr, c, t, mm: pipeline_forward_jit(pr, c, t, mm, cfg, "reference", layout, ticks)
                return Contender(fn, staged, layout.init_cache(cfg, num_pages, page_size), tok, md_rep)

            rows.append({"p": p, "m": m, "full": make(None), "no_bubble": make(m)})
            print(f"compiled p={p} m={m}", flush=True)

    for _ in range(args.rounds):  # alternate everything, so a noisy moment hits all contenders alike
        single.time(args.repeats)
        for r in rows:
            r["full"].time(args.repeats)
            r["no_bubble"].time(args.repeats)

    print(f"\nstep of {args.tokens} tokens ({args.seqs} sequences), {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"fp32, {jax.devices()[0].platform} devices; best of {args.rounds} x {args.repeats}")
    print(f"single device (all layers, plain forward): {single.best * 1e3:.2f} ms "
          f"({single.best_cpu * 1e3:.2f} ms CPU)\n")
    header = f"{'p':>2} {'m':>3} {'step ms':>9} {'m-tick ms':>10} {'x single':>9} {'idle (wall)':>12} " \
             f"{'idle (cpu)':>11} {'(p-1)/(m+p-1)':>14}"
    print(header)
    results = []
    for r in rows:
        full, nob = r["full"].best, r["no_bubble"].best
        idle = (full - nob) / full
        full_cpu, nob_cpu = r["full"].best_cpu, r["no_bubble"].best_cpu
        idle_cpu = (full_cpu - nob_cpu) / full_cpu
        formula = (r["p"] - 1) / (r["m"] + r["p"] - 1)
        print(f"{r['p']:>2} {r['m']:>3} {full * 1e3:>9.2f} {nob * 1e3:>10.2f} {full / single.best:>9.2f} "
              f"{idle:>12.3f} {idle_cpu:>11.3f} {formula:>14.3f}")
        results.append({"p": r["p"], "m": r["m"], "step_ms": full * 1e3, "m_ticks_ms": nob * 1e3,
                        "step_cpu_ms": full_cpu * 1e3, "m_ticks_cpu_ms": nob_cpu * 1e3,
                        "ratio_to_single_device": full / single.best, "idle_measured_wall": idle,
                        "idle_measured_cpu": idle_cpu, "idle_formula": formula})
    record = {
        "benchmark": "pipeline_bench", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": platform.node(), "platform": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(), "jax": jax.__version__,
        "model": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "ffw": cfg.intermediate_size,
                  "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "vocab": cfg.vocab_size, "dtype": "float32"},
        "step": {"tokens": args.tokens, "seqs": args.seqs, "tensor_parallel": 1},
        "timing": {"rounds": args.rounds, "repeats": args.repeats, "statistic": "best"},
        "single_device_ms": single.best * 1e3, "single_device_cpu_ms": single.best_cpu * 1e3,
        "results": results,
        "command": "python benchmarks/pipeline_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
