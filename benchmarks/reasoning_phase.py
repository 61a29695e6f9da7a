"""What a thinking budget costs: the same workload with and without a reasoning phase, same engine, same run.

    python benchmarks/reasoning_phase.py [--out benchmarks/results/reasoning_phase_cpu.json] [--rounds 3]

Model: the embedded default model (byte tokenizer). Workload: 32 greedy requests with
ignore_eos, prompts of 24-64 tokens, 96 output tokens each. Contenders, alternating for
`--rounds` rounds, each keeping its best time:

  plain     no reasoning parameters;
  budget    think tags `<think>` / `</think>` (7 and 8 byte tokens), output starting inside the
            block, budget 48: 48 thinking tokens, the end tag forced over 8 steps, then the answer;
  grammar   a regex answer (`[a-z ]{8,200}`) with no thinking, the plain structured-outputs path;
  budget+grammar  both: free thinking, forced end tag, then the regex.

A request with a reasoning phase goes through the grammar path (`PhasedGrammar` gives its mask
rows), so its steps are processed before the next one is scheduled, as a grammar's are; the
ratios against `plain` say what that costs here. Prints tokens/s and ratios, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving import LLM, SamplingParams  # noqa: E402
from serving.core.format_params import ReasoningParams, StructuredOutputsParams  # noqa: E402

N, OUT, BUDGET = 32, 96, 48


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=256, page_size=16, num_pages=640,
              warmup=True)
    tok = llm.tokenizer
    rng = random.Random(0)
    prompts = [[tok.BOS] + [rng.randrange(97, 123) for _ in range(rng.randrange(24, 65))] for _ in range(N)]
    tags = ReasoningParams(tok.encode("<think>", add_special_tokens=False),
                           tok.encode("</think>", add_special_tokens=False), "thinking", BUDGET)
    regex = StructuredOutputsParams(regex="[a-z ]{8,200}")
    base = dict(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    contenders = {
        "plain": SamplingParams(**base),
        "budget": SamplingParams(**base, reasoning=tags),
        "grammar": SamplingParams(**base, structured_outputs=regex),
        "budget+grammar": SamplingParams(**base, reasoning=tags, structured_outputs=regex),
    }
    for params in contenders.values():  # untimed: compiles what each path uses
        llm.generate(prompts[:4], params)
    best = {name: float("inf") for name in contenders}
    tokens = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for name, params in contenders.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - t)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "benchmark": "reasoning_phase", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_before": load_before,
        "load_after": os.getloadavg(), "requests": N, "output_tokens": OUT, "budget": BUDGET,
        "rounds": args.rounds, "seconds": best,
        "tokens_per_s": {k: tokens[k] / best[k] for k in best},
        "ratio_to_plain": {k: best["plain"] / best[k] for k in best},
    }
    for k in best:
        print(f"{k:15s} {tokens[k] / best[k]:8.1f} tok/s   {best['plain'] / best[k]:.2f}x plain")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
