"""The batch sweep: the engine across `max_num_seqs` (and token budgets) on one fixed workload.

    python benchmarks/sweep.py                                   # embedded model, default sweep
    python benchmarks/sweep.py --max_num_seqs 1,2,4,8,16,32 --token_budgets 64,256 --num_pages 96
    python benchmarks/sweep.py --random_config llama3-1b ...     # a named shape with random weights

Every point builds an `LLM` with the same weights and a KV pool of a fixed
size (`--num_pages`), then runs the same seeded offline workload twice: the
first run compiles the step shapes this point uses (prefix caching is off, so
the second run schedules exactly the same steps and compiles nothing; the
JSON records the compile count of the timed run to prove it), the second is
measured. Requests are greedy with `ignore_eos`, so every point generates the
same tokens.

Recorded per point: output tokens/s, its ratio to the `max_num_seqs=1` point
of the same token budget (the peer measured in the same run), p50/p99
inter-token latency, median time to first token, mean and peak KV-pool usage
over the steps, preemptions, steps, mean sequences per step, and the host
share of step time (scheduling, packing and output processing against the
jitted step). Throughput grows with the batch until the pool saturates; past
that knee the scheduler preempts (and recomputes) sequences, so tokens/s
flattens or falls while latency keeps growing. The plot marks the first point
whose peak usage reaches `--knee_usage` or that preempted.

Writes `<out>.json` and `<out>.png` (matplotlib, Agg backend).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.families import num_params  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.compilation.compile_cache import compile_counts  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def load_model(args):
    """(config, params, tokenizer, description): the embedded checkpoint, or a named shape with random weights."""
    if args.random_config:
        from model.families import config_by_name
        from model.params import init_params

        cfg = config_by_name(args.random_config)
        return cfg, init_params(cfg, jax.random.key(args.seed)), None, f"random weights, shape {args.random_config}"
    from model.checkpoint import load_checkpoint
    from model.tokenizer import load_tokenizer
    from serving.llm import default_checkpoint_dir

    directory = args.checkpoint or default_checkpoint_dir()
    cfg, params = load_checkpoint(directory)
    name = "embedded model (model/default)" if not args.checkpoint else directory
    return cfg, params, load_tokenizer(directory, cfg.vocab_size), name


def make_workload(args, vocab_size: int, bos: int):
    """[(prompt ids, output length)]: lengths uniform in the given ranges, token ids uniform, seeded."""
    rng = random.Random(args.seed)
    jobs = []
    for _ in range(args.num_requests):
        plen = rng.randint(*args.prompt_len)
        olen = rng.randint(*args.output_len)
        jobs.append(([bos] + [rng.randrange(3, min(vocab_size, 256)) for _ in range(plen - 1)], olen))
    return jobs


def run_workload(llm, jobs) -> dict:
    """Runs every job to completion through `Engine.step`, sampling KV usage after each step."""
    engine = llm.engine
    engine.stats_log.drain()
    preempt0 = engine.scheduler.num_preemptions
    reqs = [engine.make_request(f"sweep-{i}-{time.monotonic_ns()}", p,
                                SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
            for i, (p, o) in enumerate(jobs)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.enqueue(r)
    usage, generated = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += sum(len(o.token_ids) for o in out.outputs)
        usage.append(engine.block_manager.num_used_blocks / engine.num_pages)
    wall = time.perf_counter() - t0
    return {"wall": wall, "generated": generated, "usage": usage, "steps": engine.stats_log.drain(),
            "preemptions": engine.scheduler.num_preemptions - preempt0}


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def measure_point(cfg, params, tokenizer, jobs, args, max_num_seqs: int, budget: int) -> dict:
    llm = LLM(config=cfg, params=params, tokenizer=tokenizer, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=budget, page_size=args.page_size, num_pages=args.num_pages,
              max_model_len=args.max_model_len, enable_prefix_caching=False,
              attention_backend=args.attention_backend, min_token_bucket=args.min_token_bucket)
    c0 = compile_counts()
    t = time.perf_counter()
    run_workload(llm, jobs)  # compiles the shapes this point uses
    first_s = time.perf_counter() - t
    c1 = compile_counts()
    r = run_workload(llm, jobs)
    c2 = compile_counts()
    steps = [s for s in r["steps"] if s.num_seqs > 0]
    itl = [x for s in steps for x in s.inter_token_latencies]
    ttft = [x for s in steps for x in s.time_to_first_tokens]
    host = sum(s.host_seconds for s in steps)
    device = sum(s.device_seconds for s in steps)
    expected = sum(o for _, o in jobs)
    assert r["generated"] == expected, (r["generated"], expected)
    return {
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
        "output_tokens": r["generated"], "seconds": r["wall"], "output_tok_per_s": r["generated"] / r["wall"],
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "kv_usage_mean": float(np.mean(r["usage"])), "kv_usage_peak": float(np.max(r["usage"])),
        "preemptions": r["preemptions"], "steps": len(steps),
        "mean_seqs_per_step": statistics.fmean(s.num_seqs for s in steps),
        "host_fraction_of_step": host / (host + device) if host + device else None,
        "untimed_first_run_s": first_s,
        "executables_first_run": (c1 - c0).requests, "xla_compiles_first_run": (c1 - c0).compiled,
        "executables_timed_run": (c2 - c1).requests,
    }


def find_knee(points: list[dict], usage: float):
    """The smallest max_num_seqs whose pool peaked at `usage` or that preempted (None: never saturated)."""
    for p in sorted(points, key=lambda p: p["max_num_seqs"]):
        if p["kv_usage_peak"] >= usage or p["preemptions"] > 0:
            return p["max_num_seqs"]
    return None


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [(axes[0, 0], "output tokens/s", [("output_tok_per_s", "-o", "")]),
              (axes[0, 1], "inter-token latency (ms)", [("itl_p50_ms", "-o", " p50"), ("itl_p99_ms", "--s", " p99")]),
              (axes[1, 0], "KV pool usage (fraction of pages)",
               [("kv_usage_mean", "-o", " mean"), ("kv_usage_peak", "--s", " peak")]),
              (axes[1, 1], "preemptions", [("preemptions", "-o", "")])]
    budgets = sorted({p["max_num_batched_tokens"] for p in result["points"]})
    for ax, label, series in panels:
        for b in budgets:
            pts = sorted((p for p in result["points"] if p["max_num_batched_tokens"] == b),
                         key=lambda p: p["max_num_seqs"])
            for key, style, suffix in series:
                ax.plot([p["max_num_seqs"] for p in pts], [p[key] for p in pts], style,
                        label=f"budget {b}{suffix}")
            knee = result["knee"].get(str(b))
            if knee is not None:
                ax.axvline(knee, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_seqs")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(f"{result['model']['name']}: {w['num_requests']} requests, prompt {w['prompt_len']}, "
                 f"output {w['output_len']} tokens; KV pool {result['engine']['num_pages']} pages x "
                 f"{result['engine']['page_size']} (dotted: pool saturates)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--random_config", default=None, help="a named shape (configs/) or JSON path, random weights")
    ap.add_argument("--max_num_seqs", type=int_list, default=int_list("1,2,4,8,16,32"))
    ap.add_argument("--token_budgets", type=int_list, default=int_list("64"),
                    help="max_num_batched_tokens values (comma-separated)")
    ap.add_argument("--num_requests", type=int, default=32)
    ap.add_argument("--prompt_len", type=int_list, default=int_list("8,40"), help="min,max prompt tokens")
    ap.add_argument("--output_len", type=int_list, default=int_list("16,40"), help="min,max output tokens")
    ap.add_argument("--num_pages", type=int, default=32, help="KV pool size (small, so large batches saturate it)")
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--max_model_len", type=int, default=96)
    ap.add_argument("--min_token_bucket", type=int, default=16)
    ap.add_argument("--attention_backend", default="auto")
    ap.add_argument("--knee_usage", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "sweep_cpu_default_model"),
                    help="output path without extension (.json and .png are written)")
    args = ap.parse_args()

    cfg, params, tokenizer, name = load_model(args)
    jobs = make_workload(args, cfg.vocab_size, cfg.bos_token_id)
    load_before = os.getloadavg()
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                    "device": str(jax.devices()[0]), "loadavg_before": load_before},
        "model": {"name": name, "params_millions": num_params(cfg) / 1e6, "layers": cfg.num_layers,
                  "hidden": cfg.hidden_size, "dtype": str(cfg.dtype)},
        "engine": {"num_pages": args.num_pages, "page_size": args.page_size, "max_model_len": args.max_model_len,
                   "min_token_bucket": args.min_token_bucket, "prefix_caching": False,
                   "kv_pool_tokens": args.num_pages * args.page_size},
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "seed": args.seed, "greedy_ignore_eos": True,
                     "prompt_tokens": sum(len(p) for p, _ in jobs), "output_tokens": sum(o for _, o in jobs),
                     "pages_if_all_resident": sum(-(-(len(p) + o) // args.page_size) for p, o in jobs)},
        "points": [],
    }
    log(f"model {name}; {len(jobs)} requests, {result['workload']['output_tokens']} output tokens; "
        f"KV pool {args.num_pages} pages x {args.page_size}")
    for budget in args.token_budgets:
        for n in args.max_num_seqs:
            if n > budget:
                continue
            p = measure_point(cfg, params, tokenizer, jobs, args, n, budget)
            result["points"].append(p)
            log(f"budget {budget:4d} max_num_seqs {n:3d}: {p['output_tok_per_s']:8.1f} tok/s, "
                f"ITL p50 {p['itl_p50_ms']:6.1f} ms p99 {p['itl_p99_ms']:6.1f} ms, KV mean "
                f"{p['kv_usage_mean']:.2f} peak {p['kv_usage_peak']:.2f}, {p['preemptions']} preemptions, "
                f"{p['steps']} steps, host {100 * p['host_fraction_of_step']:.0f}% of step, "
                f"{p['executables_timed_run']} compiles in the timed run")
    for p in result["points"]:
        peer = next((q for q in result["points"] if q["max_num_batched_tokens"] == p["max_num_batched_tokens"]
                     and q["max_num_seqs"] == 1), None)
        p["tok_per_s_vs_max_num_seqs_1"] = p["output_tok_per_s"] / peer["output_tok_per_s"] if peer else None
    result["knee"] = {str(b): find_knee([p for p in result["points"] if p["max_num_batched_tokens"] == b],
                                        args.knee_usage) for b in args.token_budgets}
    result["machine"]["loadavg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")
    log(f"knee (pool saturates) at max_num_seqs = {result['knee']}; wrote {args.out}.json and .png")


if __name__ == "__main__":
    main()
