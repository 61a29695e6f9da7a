"""The layer loop's three programs side by side: compile time against depth, batch-1 decode, a mixed workload.

    python benchmarks/layer_loop.py                       # 4 and 32 layers of the 135M Llama shape
    python benchmarks/layer_loop.py --layers 4 --quick    # checks the script runs

Contenders, for each depth, measured in one process and in one run:

* `unroll`: every layer its own code (`--layer_loop=unroll`);
* `scan` (switch): one scanned layer body whose matmuls pick their layer's
  matrix by `lax.switch` (`model.layer_select`; what `--layer_loop=scan` runs
  on XLA CPU);
* `scan` (stacked): one scanned layer body slicing `[layers, ...]` stacked
  weights (what `--layer_loop=scan` runs on GPUs; on CPU it copies each slice).

Per contender and depth: the compile time of one step bucket (T=16), the
batch-1 decode rate (one 16-token prompt, 64 greedy tokens) and a mixed
workload's output rate (24 requests, prompts of 16-256 tokens, 8-64 new
tokens, in one batch). The three engines of a depth are built (and their
buckets compiled) first; then the timed runs alternate between them,
`--rounds` times, and each keeps its best, so that load which comes and goes
on a shared machine falls on all three alike. The model is the 135M Llama shape
(hidden 576, 9 query / 3 KV heads, intermediate 1536, vocab 49152, tied
embeddings) with random fp32 weights. Writes
benchmarks/results/layer_loop_cpu.json (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax
import numpy as np

from model.config import LlamaConfig
from model.params import init_params
from serving import LLM, SamplingParams
from serving.core import model_runner
from serving.core.input_batch import StepShape

CONTENDERS = ("unroll", "scan_switch", "scan_stacked")


def config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=layers, num_heads=9,
                       num_kv_heads=3, head_dim=64, tie_word_embeddings=True, dtype="float32")


def build(cfg, params, contender: str, **engine) -> LLM:
    """An engine of `contender`; "scan_stacked" on CPU by turning the switch off for this build."""
    select = model_runner.selects_layers
    if contender == "scan_stacked":
        model_runner.selects_layers = lambda layers, platform: False
    try:
        return LLM(config=cfg, params=params, layer_loop="unroll" if contender == "unroll" else "scan", **engine)
    finally:
        model_runner.selects_layers = select


def compile_seconds(llm: LLM) -> float:
    runner = llm.engine.runner
    shape = next(s for s in runner.warm_up_order() if s.T == 16)
    t = time.perf_counter()
    runner._lower_step(StepShape(shape.T, shape.S, shape.P)).compile()
    return time.perf_counter() - t


def batch1_seconds(llm: LLM, new_tokens: int) -> float:
    prompt = list(range(1, 17))
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == new_tokens
    return time.perf_counter() - t


def mixed_jobs(n: int):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, int(rng.integers(16, 257))).tolist() for _ in range(n)]
    sps = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 65)), ignore_eos=True) for _ in range(n)]
    return prompts, sps


def mixed_seconds(llm: LLM, jobs) -> float:
    t = time.perf_counter()
    llm.generate(*jobs)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="4,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and requests: checks the script runs")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "layer_loop_cpu.json"))
    args = ap.parse_args()
    new_tokens, requests = (8, 4) if args.quick else (64, 24)
    engine = dict(max_num_seqs=requests, max_num_batched_tokens=256, max_model_len=512, page_size=16,
                  num_pages=requests * 512 // 16, enable_prefix_caching=False)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        cfg = config(layers)
        params = init_params(cfg, jax.random.PRNGKey(0))
        jobs = mixed_jobs(requests)
        useful = sum(sp.max_tokens for sp in jobs[1])
        engines, depth_rows = {}, {}
        for contender in CONTENDERS:
            llm = engines[contender] = build(cfg, params, contender, **engine)
            depth_rows[contender] = {"layers": layers, "contender": contender,
                                     "compile_seconds_T16": compile_seconds(llm)}
            batch1_seconds(llm, 2), mixed_seconds(llm, jobs)  # compiles the buckets the timed runs use
        best = {c: {"batch1": float("inf"), "mixed": float("inf")} for c in CONTENDERS}
        for _ in range(args.rounds):
            for contender, llm in engines.items():
                best[contender]["batch1"] = min(best[contender]["batch1"], batch1_seconds(llm, new_tokens))
                best[contender]["mixed"] = min(best[contender]["mixed"], mixed_seconds(llm, jobs))
        for contender, row in depth_rows.items():
            row.update(batch1_decode_tok_s=new_tokens / best[contender]["batch1"],
                       mixed_output_tok_s=useful / best[contender]["mixed"])
            rows.append(row)
            print(json.dumps(row), flush=True)
        for llm in engines.values():
            llm.shutdown()
        del engines, llm
        jax.clear_caches()
    print(f"\n{'layers':>6} {'contender':>13} {'compile T=16':>13} {'batch-1 tok/s':>14} {'mixed tok/s':>12}")
    for r in rows:
        base = next(b for b in rows if b["layers"] == r["layers"] and b["contender"] == "unroll")
        print(f"{r['layers']:>6} {r['contender']:>13} {r['compile_seconds_T16']:>11.1f} s "
              f"{r['batch1_decode_tok_s']:>8.1f} ({r['batch1_decode_tok_s'] / base['batch1_decode_tok_s']:.2f}x) "
              f"{r['mixed_output_tok_s']:>6.1f} ({r['mixed_output_tok_s'] / base['mixed_output_tok_s']:.2f}x)")
    for contender in CONTENDERS:
        by_depth = {r["layers"]: r["compile_seconds_T16"] for r in rows if r["contender"] == contender}
        if len(by_depth) > 1:
            lo, hi = min(by_depth), max(by_depth)
            print(f"{contender}: compile at {hi} layers = {by_depth[hi] / by_depth[lo]:.2f}x the {lo}-layer one")
    if not args.quick:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": platform.machine(),
                       "cpus": os.cpu_count(), "jax": jax.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
