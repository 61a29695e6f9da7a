"""Speculative decoding on the embedded model pair: acceptance, tokens per pass, single-stream speedup.

    python benchmarks/spec_decode.py [--out benchmarks/results/spec_decode_cpu_default_model.json]
                                     [--max_k 6] [--new_tokens 96] [--prompts 3] [--rounds 2]

Target: the embedded default model (model/default, 4 layers, hidden 256);
draft: the embedded draft model (model/default_draft, 2 layers, hidden 128),
both byte-level over the same tokenizer. Prompts: the first 240 bytes of
held-out CPython standard-library files (the split model/train.py holds out,
so neither model trained on them). Greedy decoding, one request at a time
(single stream), `--new_tokens` tokens each with ignore_eos.

For every proposer (draft, ngram) and k = 1..max_k, in the same process:

* alpha: accepted / drafted tokens;
* tokens per target pass of a verifying sequence, next to the i.i.d.
  prediction 1 + alpha + ... + alpha^k;
* end-to-end speedup: the time of the same requests without speculation
  divided by the time with it, by wall clock and by this process's CPU time
  (less sensitive to other work on a shared machine). Every configuration
  first runs the prompts once untimed (compiling the shapes they use); then
  the baseline and the configuration alternate for `--rounds` rounds and
  each keeps its best time (the JSON records the load average). The JSON is
  rewritten after every configuration.

The output is identical with and without speculation (greedy); the script
checks it.
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

from model.train import stdlib_files  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.spec_decode import SpecDecoder

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=16, min_token_bucket=16,
              min_context_bucket=512, max_model_len=512, attention_backend="reference", enable_prefix_caching=False)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts(n: int, num_bytes: int = 240) -> list[str]:
    _, held = stdlib_files()
    out = []
    for path in held:
        with open(path, "rb") as f:
            text = f.read(num_bytes).decode("utf-8", errors="ignore")
        if len(text) >= num_bytes // 2:
            out.append(text)
        if len(out) == n:
            break
    return out


def run(llm, texts, new_tokens):
    """(wall seconds, CPU seconds of this process, outputs): one request at a time."""
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = [llm.generate([t], sp)[0].outputs[0].token_ids for t in texts]
    return time.perf_counter() - t0, time.process_time() - c0, outs


def predicted_tokens_per_pass(alpha: float, k: int) -> float:
    return sum(alpha ** i for i in range(k + 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/spec_decode_cpu_default_model.json")
    ap.add_argument("--max_k", type=int, default=6)
    ap.add_argument("--new_tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default="draft,ngram")
    args = ap.parse_args()
    load_before = os.getloadavg()
    texts = prompts(args.prompts)
    base = LLM(**ENGINE)
    run(base, texts, args.new_tokens)  # compiles
    base_wall, base_cpu, want = run(base, texts, args.new_tokens)
    log(f"baseline: {base_wall:.2f} s ({base_cpu:.2f} s CPU) for {len(texts)} x {args.new_tokens} tokens")
    rows = []
    result = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)", "jax_backend": "cpu",
        "target": "model/default", "draft": "model/default_draft", "engine": ENGINE,
        "prompts": len(texts), "new_tokens": args.new_tokens, "rounds": args.rounds,
        "load_avg_before": load_before, "rows": rows,
    }
    for method in args.methods.split(","):
        for k in range(1, args.max_k + 1):
            llm = LLM(speculative_method=method, num_speculative_tokens=k, **ENGINE)
            run(llm, texts, args.new_tokens)  # compiles
            spec = llm.engine.part(SpecDecoder)
            spec.stats.__init__(accepted_per_position=[0] * k)  # count the timed rounds only
            wall = cpu = float("inf")
            for _ in range(args.rounds):
                bw, bc, _ = run(base, texts, args.new_tokens)
                base_wall, base_cpu = min(base_wall, bw), min(base_cpu, bc)
                sw, sc, got = run(llm, texts, args.new_tokens)
                wall, cpu = min(wall, sw), min(cpu, sc)
                assert got == want, f"{method} k={k}: greedy output differs from no speculation"
            st = spec.stats
            alpha = st.acceptance_rate
            row = {
                "method": method, "k": k, "alpha": round(alpha, 4),
                "tokens_per_pass": round(st.mean_tokens_per_pass, 3),
                "predicted_tokens_per_pass": round(predicted_tokens_per_pass(alpha, k), 3),
                "drafted": st.num_draft_tokens, "accepted": st.num_accepted_tokens, "verify_passes": st.num_drafts,
                "accepted_per_position": list(st.accepted_per_position),
                "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
            }
            rows.append(row)
            log(f"{method} k={k}: alpha {alpha:.3f}, tokens/pass {row['tokens_per_pass']:.2f} "
                f"(1+a+..+a^k = {row['predicted_tokens_per_pass']:.2f}), {wall:.2f} s vs {base_wall:.2f} s, "
                f"CPU {cpu:.2f} s vs {base_cpu:.2f} s")
            # Written after every configuration (a long run on a shared machine may be cut short).
            for r in rows:  # against the baseline's best over the run so far
                r["speedup"] = round(base_wall / r["seconds"], 3)
                r["cpu_speedup"] = round(base_cpu / r["cpu_seconds"], 3)
            result.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          baseline_seconds=round(base_wall, 3), baseline_cpu_seconds=round(base_cpu, 3),
                          baseline_tokens_per_s=round(len(texts) * args.new_tokens / base_wall, 1),
                          load_avg_after=os.getloadavg())
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    print(f"\n{'method':>6} {'k':>2} {'alpha':>6} {'tok/pass':>8} {'1+a..a^k':>8} {'speedup':>7} {'CPU':>6}")
    for r in rows:
        print(f"{r['method']:>6} {r['k']:>2} {r['alpha']:>6.3f} {r['tokens_per_pass']:>8.2f} "
              f"{r['predicted_tokens_per_pass']:>8.2f} {r['speedup']:>6.2f}x {r['cpu_speedup']:>5.2f}x")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
