"""What fewer step buckets would cost in speed: small decodes padded to more rows, or to the largest page bucket.

    python benchmarks/bucket_padding.py              # ~8 min on 2 cores
    python benchmarks/bucket_padding.py --rounds 1
    python benchmarks/bucket_padding.py --cut prefill_pages   # the cut the bucket set took

A server compiles one step program per bucket, and on a 2-core CPU the
30-layer 135M shape's background warm-up (49 buckets) takes about three
minutes. Each bucket left out saves one compile but makes some steps run in a
larger one. This measures, on that shape with random float32 weights, the
two cuts that remove the most buckets among decode-sized steps:

* **rows**: decodes of 1, 2 and 4 rows computed in the 8-row bucket
  (`min_token_bucket=8`: 18 buckets fewer);
* **pages**: decode-sized steps from 8, 4 or 2 rows up run in the largest page
  bucket, as steps of 16 rows and more already do (`Buckets.one_page_bucket`:
  5, 10 or 15 buckets fewer).

Workloads: 2, 4 and 8 requests, prompts of 40 and 300 tokens (short
contexts take the smallest page buckets, where padding to the largest costs
most), 48 greedy tokens each; engines with every variant built in one
process, each workload run once untimed (its buckets compile), then timed runs
alternate between the engines, the order rotating each round, best of
`--rounds` kept (`attention_cpu_bench.best_of_rotating_rounds`). Reported: seconds per
engine and each variant's time over the default engine's.

`--cut prefill_pages` weighs the cut the bucket set took instead: every step
of 16 tokens or more at the largest page bucket (`Buckets.one_page_bucket`;
34 buckets) against prefill-sized steps with a bucket per page count, as
before (49), on those workloads and on prefill-heavy ones (many short prompts,
a few 200-token ones, one long one chunked), where short contexts in the
largest page bucket would cost most, and on `offline_throughput.py`'s mixed
workload (32 requests, prompts and outputs of 16-256 tokens).

Writes benchmarks/results/bucket_padding_cpu.json (or `--out`; with
`--cut prefill_pages`, bucket_padding_prefill_pages_cpu.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import functools
import platform

import jax
import numpy as np

import layer_loop
from attention_cpu_bench import best_of_rotating_rounds
import startup
from model.params import init_params
from serving import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(cfg, params, one_page_from=None, prefill_pages=False, **engine) -> LLM:
    """An engine whose decode-sized steps of at least `one_page_from` rows take the largest page bucket
    (with `prefill_pages`, prefill-sized steps keep a bucket per page count, as before the cut)."""
    llm = LLM(config=cfg, params=params, compilation_cache_dir="", warmup=False, async_scheduling=False, **engine)
    if one_page_from is not None:
        buckets = llm.engine.buckets  # (the runner's too: one object)
        object.__setattr__(buckets, "one_page_bucket",
                           lambda T: one_page_from <= T <= buckets.max_num_seqs
                           or (T > buckets.max_num_seqs and not prefill_pages))
    return llm


def workloads(cut: str, vocab: int):
    """(name, prompts, SamplingParams) of the runs: 2, 4 and 8 requests of 40 and 300 tokens decoding 48
    each, and for `prefill_pages` also prefill-heavy batches."""
    rng = np.random.default_rng(0)

    def prompts(n, length):
        return [list(map(int, rng.integers(3, vocab, size=length))) for _ in range(n)]

    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = [(f"{n} x {length}, 48 new", prompts(n, length), sp) for n in (2, 4, 8) for length in (40, 300)]
    if cut == "prefill_pages":
        from offline_throughput import workload  # its mixed workload: 32 requests, prompts and outputs of 16-256

        jobs = workload(32, 1234, vocab)
        runs += [("32 mixed (offline_throughput)", [p for p, _ in jobs],
                  [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs])]
        runs += [("48 x 30, 8 new", prompts(48, 30), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
                 ("12 x 200, 4 new", prompts(12, 200), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
                 ("1 x 1500, 1 new", prompts(1, 1500), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))]
    return runs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cut", default="decodes", choices=("decodes", "prefill_pages"))
    p.add_argument("--only", default=None, help="run only the workloads whose name contains this")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", "bucket_padding_cpu.json" if args.cut == "decodes"
                                   else "bucket_padding_prefill_pages_cpu.json")
    cfg = layer_loop.config(30).replace(max_position_embeddings=2048)  # the 135M shape, as startup.py serves it
    params = init_params(cfg, jax.random.key(0))
    if args.cut == "prefill_pages":
        engines = {"default": build(cfg, params),
                   "prefill-sized steps per page bucket": build(cfg, params, 16, prefill_pages=True)}
    else:
        engines = {"default": build(cfg, params), "rows padded to 8": build(cfg, params, min_token_bucket=8),
                   "one page bucket from 8 rows": build(cfg, params, 8),
                   "one page bucket from 4 rows": build(cfg, params, 4),
                   "one page bucket from 2 rows": build(cfg, params, 2)}
    rows = []
    for name, prompts, sp in workloads(args.cut, cfg.vocab_size):
        if args.only and args.only not in name:
            continue
        tokens = {engine: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
                  for engine, llm in engines.items()}
        best = best_of_rotating_rounds({engine: functools.partial(llm.generate, prompts, sp)
                                        for engine, llm in engines.items()}, args.rounds)
        row = {"workload": name, "seconds": {k: round(v, 3) for k, v in best.items()},
               "over_default": {k: round(v / best["default"], 3) for k, v in best.items()},
               "same_tokens": all(t == tokens["default"] for t in tokens.values())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "model": "135M shape, 30 layers, float32, random weights", "rounds": args.rounds,
              "buckets": {name: len(llm.engine.buckets.all_shapes()) for name, llm in engines.items()},
              "rows": rows}
    startup.save(out, result)
    return result


if __name__ == "__main__":
    main()
