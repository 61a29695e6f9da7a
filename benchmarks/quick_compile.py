"""Compiler options against XLA's defaults: compile time of the minimal warm-up set, and step speed.

    python benchmarks/quick_compile.py              # the quick options, on the embedded model
    python benchmarks/quick_compile.py --rounds 1   # a shorter run
    python benchmarks/quick_compile.py --options '{"xla_cpu_use_fusion_emitters": false}' \
        --model 135m-30l --out benchmarks/results/legacy_emitters_135m_cpu.json

A server's warm-up compiles two step buckets before it serves (the batch-1
decode and the largest bucket). With `--quick_warmup_compile` (the default)
they compile with `step_programs.QUICK_COMPILE_OPTIONS` for the platform (XLA
CPU: LLVM -O0) and serve until the background thread's full compiles replace
them. This measures, in one process and one run, what that trades (or what any
other `--options` would, on the embedded model or the 30-layer 135M shape of
`benchmarks/startup.py` with random weights):

* compile: the XLA compile of the two buckets with each option set (the
  lowering, which is the same for both, is timed apart), alternating
  `--rounds` times, best kept;
* speed: `LLM.generate` on two engines whose every bucket is compiled one way
  or the other: one request (a 16-token prompt, 64 greedy tokens), 16
  greedy requests (prompts of 5-200 tokens, 64 tokens each) and the same 16
  sampled (temperature 0.8, top_p 0.9, seeded); timed runs alternate between
  the two engines, best kept; and whether their tokens are the same.

Results name the two sides "defaults" and "options". Writes
benchmarks/results/quick_compile_cpu.json (or `--out`).
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

import layer_loop
import startup
from model.params import init_params
from serving import LLM, SamplingParams
from serving.compilation import step_programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_seconds(runner, shapes, options, rounds: int) -> dict:
    """Best XLA compile time of each of `shapes` with `options` (None: the defaults), and of lowering."""
    best = {}
    for _ in range(rounds):
        for shape in shapes:
            jax.clear_caches()
            t = time.perf_counter()
            lowered = runner._lower_step(shape)
            t1 = time.perf_counter()
            lowered.compile(compiler_options=options) if options else lowered.compile()
            t2 = time.perf_counter()
            name = f"T={shape.T},P={shape.P}"
            best[name] = min(best.get(name, 1e9), round(t2 - t1, 2))
            best["lower " + name] = min(best.get("lower " + name, 1e9), round(t1 - t, 2))
    return best


class Compiling:
    """A `StepPrograms` lowering whose compile uses the given options (None: the defaults)."""

    def __init__(self, lowered, options):
        self.lowered, self.options = lowered, options

    def compile(self, compiler_options=None):
        return self.lowered.compile(compiler_options=self.options) if self.options else self.lowered.compile()


def engine(options, tag: str, model: str) -> LLM:
    if model == "embedded":
        llm = LLM(compilation_cache_dir="")  # nothing loaded from an earlier run: every bucket compiles here
    else:  # the 30-layer 135M shape, float32 as on a CPU server
        cfg = layer_loop.config(30).replace(max_position_embeddings=2048)  # as benchmarks/startup.py serves it
        llm = LLM(config=cfg, params=init_params(cfg, jax.random.key(0)), compilation_cache_dir="")
    programs = llm.engine.runner.programs
    lower, key = programs._lower, programs._key
    programs._lower = lambda shape: Compiling(lower(shape), options)
    programs._key = lambda shape: (tag, key(shape))  # the two engines must not share executables
    return llm


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--options", default=None,
                   help="compiler options to compare against the defaults, as JSON (default: the quick ones)")
    p.add_argument("--model", choices=("embedded", "135m-30l"), default="embedded")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quick_compile_cpu.json"))
    args = p.parse_args(argv)
    candidate = (json.loads(args.options) if args.options
                 else step_programs.QUICK_COMPILE_OPTIONS.get(jax.default_backend()))
    if candidate is None:
        raise SystemExit(f"no quick compile options for {jax.default_backend()}: nothing to compare")

    defaults_llm, options_llm = engine(None, "defaults", args.model), engine(candidate, "options", args.model)
    runner = defaults_llm.engine.runner
    order = runner.warm_up_order()
    minimal = [order[0], order[-1]]
    compiles = {"defaults": {}, "options": {}}
    for _ in range(args.rounds):  # alternating, so load that comes and goes falls on both
        for name, options in (("defaults", None), ("options", candidate)):
            for k, v in compile_seconds(runner, minimal, options, 1).items():
                compiles[name][k] = min(compiles[name].get(k, 1e9), v)
    for c in compiles.values():
        c["both buckets"] = round(sum(v for k, v in c.items() if not k.startswith("lower")), 2)

    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, 300, size=int(rng.integers(5, 200))))) for _ in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, ignore_eos=True, seed=1)
    workloads = {"batch 1 greedy": ([list(range(1, 17))], greedy), "16 greedy": (prompts, greedy),
                 "16 sampled": (prompts, sampled)}
    for llm in (defaults_llm, options_llm):  # every bucket these workloads use, compiled before timing
        for batch, params in workloads.values():
            llm.generate(batch, params)
    speed = {name: {} for name in ("defaults", "options")}
    tokens = {name: {} for name in ("defaults", "options")}
    for _ in range(args.rounds):
        for work, (batch, params) in workloads.items():
            for name, llm in (("defaults", defaults_llm), ("options", options_llm)):
                t = time.perf_counter()
                outs = llm.generate(batch, params)
                rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
                speed[name][work] = max(speed[name].get(work, 0.0), round(rate, 1))
                tokens[name][work] = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": args.model, "options": candidate, "minimal_set": [f"T={s.T},P={s.P}" for s in minimal], "rounds": args.rounds,
        "compile_seconds": compiles, "tokens_per_second": speed,
        "options_vs_defaults_speed": {w: round(speed["options"][w] / speed["defaults"][w], 2) for w in workloads},
        "same_tokens": {w: tokens["options"][w] == tokens["defaults"][w] for w in workloads},
    }
    print(json.dumps(result, indent=1))
    startup.save(args.out, result)
    return result


if __name__ == "__main__":
    main()
