"""The first `LLM.generate` of a fresh process against transformers, same weights, same run.

    python benchmarks/first_generate.py [--out benchmarks/results/first_generate_cpu.json] [--quick]

What a user sees the first time a script runs: `LLM(checkpoint=...)` and one
`generate` of the mixed workload of `offline_throughput.py` (32 requests,
prompts and outputs uniform in 16-256 tokens, greedy, `ignore_eos`), each
contender in its own fresh process, one after the other, all in one run:

  * transformers: the model loaded from the same weights, its best static
    setting (one batch of 32, or batches of 8 sorted by length), useful
    tokens per second of its generate calls; run first and again, in that
    best setting, after the ridgeline processes, and compared by the mean of
    the two (the machine's load drifts over a run of several minutes, and
    transformers' one large batch has swung by 1.7x between runs: the two
    figures show how far it moved within this one);
  * ridgeline, cold: a fresh process with an empty persistent compilation
    cache (`compilation_cache_dir` a new empty directory);
  * ridgeline, warm: the same script again over the cache the cold run left;
    this process then idles until the buckets its steps were padded out of
    have compiled (`StepPrograms.end_call`: what a notebook or a long job
    does between calls, and a script that exits at once does not);
  * ridgeline, warm after an idle: the same script over the cache that left;
  * in each process, a second `generate` of the same workload with the prefix
    cache reset first, so it recomputes every prompt (the process's steady state);
  * with `--baseline_warmup off` (the default), ridgeline again over an empty
    cache with `LLM(warmup=False)`: every bucket compiled on first use, as
    `LLM` did before it compiled as needed (a same-run before/after).

Ratios are of useful output tokens per second of the first `generate` call, and,
"with construction", of the tokens over `LLM(...)` plus that call against
transformers' model load plus its generate.

For the cold process it also prints where the first call's time went, from
JAX's own monitoring events: tracing, lowering to StableHLO, XLA compiling,
and what is left (running steps, host work, waiting for the background
warm-up), plus how many executables were compiled and when the background
warm-up had finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# JAX's monitoring events for the parts of a compile (jax._src.dispatch / pxla / compiler).
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "xla_compile",
}


def _uptime() -> str:
    """`uptime`'s line: the machine is shared, and its load is part of every number here."""
    return subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip()


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _shape(quick: bool) -> dict:
    from benchmarks.offline_throughput import SHAPE_125M

    shape = dict(SHAPE_125M)
    if quick:
        shape.update(num_layers=2, vocab_size=4096)
    return shape


def _jobs(args, vocab: int):
    from benchmarks.offline_throughput import workload

    return workload(args.num_requests, 1234, vocab)


def child_transformers(args) -> dict:
    import torch  # noqa: F401  (imported before the clock: both contenders' imports are outside it)
    from benchmarks.offline_throughput import hf_model_from, hf_run
    from model.checkpoint import load_checkpoint

    t = time.perf_counter()
    cfg, params = load_checkpoint(args.checkpoint)
    hf = hf_model_from(cfg, params)
    load = time.perf_counter() - t
    jobs = _jobs(args, cfg.vocab_size)
    useful = sum(o for _, o in jobs)
    runs = {}
    settings = ((f"one_batch_of_{len(jobs)}", len(jobs), False), ("batches_of_8_sorted", 8, True))
    for name, bs, sort in [s for s in settings if args.hf_setting in (None, s[0])]:
        w = hf_run(hf, jobs, bs, sort)
        runs[name] = {"seconds": w, "useful_output_tok_per_s": useful / w}
        log(f"transformers {name}: {w:.1f}s = {useful / w:.1f} useful tok/s")
    best = max(runs, key=lambda k: runs[k]["useful_output_tok_per_s"])
    return {"load_seconds": load, "runs": runs, "best": best,
            "useful_output_tok_per_s": runs[best]["useful_output_tok_per_s"]}


def child_ridgeline(args) -> dict:
    t_import = time.perf_counter()
    import jax

    from serving import LLM, SamplingParams
    from serving.compilation import compile_cache

    import_seconds = time.perf_counter() - t_import
    spent = {name: 0.0 for name in COMPILE_EVENTS.values()}
    counts = {name: 0 for name in COMPILE_EVENTS.values()}

    def on_event(event: str, seconds: float, **_):
        name = COMPILE_EVENTS.get(event)
        if name is not None:
            spent[name] += seconds
            counts[name] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)

    def snapshot():
        return dict(spent), dict(counts), compile_cache.compile_counts()

    t = time.perf_counter()
    llm = LLM(args.checkpoint, compilation_cache_dir=args.cache_dir, **json.loads(args.llm_options))
    construct = time.perf_counter() - t
    after_construct = snapshot()
    jobs = _jobs(args, llm.config.vocab_size)
    useful = sum(o for _, o in jobs)
    sps = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in jobs]

    def run():
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in jobs], sps)
        wall = time.perf_counter() - t
        assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in jobs]
        return wall, [o.outputs[0].token_ids for o in outs]

    first, first_tokens = run()
    after_first = snapshot()
    warmup = llm.engine.runner.warmup_stats()
    llm.engine.reset_prefix_cache()  # the second call recomputes every prompt, as the first did
    second, second_tokens = run()
    after_second = snapshot()
    assert first_tokens == second_tokens, "the first and second generate disagree"
    idle = None
    if args.idle_fill:
        from serving.compilation import step_programs

        programs = llm.engine.runner.programs
        t = time.perf_counter()
        programs.wait_filled()
        idle = {"seconds": time.perf_counter() - t, "idle_before_first_fill": step_programs.FILL_AFTER_IDLE_SECONDS,
                "buckets_filled": programs.stats().filled}

    def parts(before, after):
        (s0, c0, k0), (s1, c1, k1) = before, after
        return {"seconds": {k: s1[k] - s0[k] for k in s1}, "events": {k: c1[k] - c0[k] for k in c1},
                "xla_compiled": k1.compiled - k0.compiled, "persistent_cache_hits": k1.cache_hits - k0.cache_hits}

    zero = ({k: 0.0 for k in spent}, {k: 0 for k in counts}, compile_cache.CompileCounts(0, 0))
    llm.shutdown()
    return {"import_seconds": import_seconds, "construct_seconds": construct,
            "first_generate_seconds": first, "second_generate_seconds": second,
            "first_output_tok_per_s": useful / first, "second_output_tok_per_s": useful / second,
            "construct_compile": parts(zero, after_construct),
            "first_generate_compile": parts(after_construct, after_first),
            # The second call's prompts hit the prefix cache, so its prefill steps are smaller than the first's.
            "second_generate_compile": parts(after_first, after_second),
            "warmup_after_first_generate": {"total": warmup.total, "compiled": warmup.compiled,
                                            "steps_in_larger_bucket": warmup.steps_in_larger_bucket,
                                            "compiles_after_ready": warmup.compiles_after_ready},
            "idle_fill": idle,
            "useful_output_tokens": useful}


def run_child(mode: str, args, cache_dir: str | None = None, idle_fill: bool = False,
              hf_setting: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--checkpoint", args.checkpoint,
           "--num_requests", str(args.num_requests), "--llm_options", args.llm_options]
    if hf_setting is not None:
        cmd += ["--hf_setting", hf_setting]
    if idle_fill:
        cmd.append("--idle_fill")
    if cache_dir is not None:
        cmd += ["--cache_dir", cache_dir]
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE)).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - t
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "first_generate_cpu.json"))
    ap.add_argument("--quick", action="store_true", help="8 requests, 2 layers: checks the script runs")
    ap.add_argument("--num_requests", type=int, default=32)
    ap.add_argument("--llm_options", default="{}", help="JSON of extra LLM(...) keywords for ridgeline")
    ap.add_argument("--baseline_warmup", default="off", choices=("off", "full", "background", "as_needed", ""),
                    help="also run ridgeline cold with LLM(warmup=...) of this mode ('' skips it)")
    ap.add_argument("--child", choices=("transformers", "ridgeline"), help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--cache_dir", help=argparse.SUPPRESS)
    ap.add_argument("--idle_fill", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf_setting", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child_transformers(args) if args.child == "transformers" else child_ridgeline(args)
        print(json.dumps(result))
        return
    if args.quick:
        args.num_requests = min(args.num_requests, 8)

    import jax

    from model.checkpoint import save_checkpoint
    from model.config import LlamaConfig
    from model.params import init_params

    shape = _shape(args.quick)
    cfg = LlamaConfig(**shape)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                          "loadavg_before": os.getloadavg(), "uptime_before": _uptime()},
              "model": {k: v for k, v in shape.items() if k != "eos_token_ids"},
              "requests": args.num_requests, "llm_options": json.loads(args.llm_options)}
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = os.path.join(tmp, "checkpoint")
        save_checkpoint(args.checkpoint, init_params(cfg, jax.random.key(0)), cfg)
        cache = os.path.join(tmp, "compilation-cache")
        os.makedirs(cache)
        log("transformers ...")
        hf = run_child("transformers", args)
        log("ridgeline, empty compilation cache ...")
        cold = run_child("ridgeline", args, cache)
        log("ridgeline, the compilation cache the first run left ...")
        warm = run_child("ridgeline", args, cache, idle_fill=True)
        log("ridgeline, the compilation cache the warm run left after idling ...")
        filled = run_child("ridgeline", args, cache)
        baseline = None
        if args.baseline_warmup:
            log(f"ridgeline, warmup={args.baseline_warmup}, empty compilation cache ...")
            empty = os.path.join(tmp, "compilation-cache-baseline")
            os.makedirs(empty)
            args.llm_options = json.dumps({**json.loads(args.llm_options),
                                           "warmup": {"off": False, "full": True}.get(args.baseline_warmup,
                                                                                       args.baseline_warmup)})
            baseline = run_child("ridgeline", args, empty)
        log(f"transformers again, {hf['best']} ...")
        hf_after = run_child("transformers", args, hf_setting=hf["best"])
    peers = (hf, hf_after)
    base = sum(p["useful_output_tok_per_s"] for p in peers) / 2
    hf_total = sum(p["load_seconds"] + p["runs"][hf["best"]]["seconds"] for p in peers) / 2

    def with_construction(r):
        return hf_total / (r["construct_seconds"] + r["first_generate_seconds"])

    ratios = {"first_generate_cold_cache": cold["first_output_tok_per_s"] / base,
              "first_generate_warm_cache": warm["first_output_tok_per_s"] / base,
              "first_generate_warm_filled_cache": filled["first_output_tok_per_s"] / base,
              "second_generate_same_process": cold["second_output_tok_per_s"] / base,
              "second_generate_same_process_filled_cache": filled["second_output_tok_per_s"] / base,
              "with_construction_cold_cache": with_construction(cold),
              "with_construction_warm_cache": with_construction(warm),
              "with_construction_warm_filled_cache": with_construction(filled)}
    if baseline is not None:
        ratios["first_generate_cold_cache_baseline_warmup"] = baseline["first_output_tok_per_s"] / base
        ratios["with_construction_cold_cache_baseline_warmup"] = with_construction(baseline)
    result.update(transformers=hf, transformers_after=hf_after, transformers_mean_tok_per_s=base,
                  ridgeline_cold=cold, ridgeline_warm=warm, ridgeline_warm_filled=filled,
                  ratio_vs_transformers=ratios,
                  baseline_warmup=args.baseline_warmup or None, ridgeline_cold_baseline_warmup=baseline)
    result["machine"]["loadavg_after"] = os.getloadavg()
    result["machine"]["uptime_after"] = _uptime()
    result["command"] = " ".join([os.path.relpath(sys.argv[0], os.path.dirname(HERE))] + sys.argv[1:])
    print(f"transformers ({hf['best']}): {base:.1f} useful tok/s, the mean of {hf['useful_output_tok_per_s']:.1f} "
          f"first and {hf_after['useful_output_tok_per_s']:.1f} last (model load {hf['load_seconds']:.1f}s)")
    rows = [("cold", cold, "_cache"), ("warm", warm, "_cache"), ("warm_filled", filled, "_cache")]
    if baseline is not None:
        rows.append((f"cold, warmup={args.baseline_warmup}", baseline, "_cache_baseline_warmup"))
    for name, r, suffix in rows:
        c = r["first_generate_compile"]
        key = name.split(",")[0] + suffix
        print(f"ridgeline {name}: LLM() {r['construct_seconds']:.1f}s, first generate {r['first_generate_seconds']:.1f}s "
              f"({r['first_output_tok_per_s']:.1f} tok/s, {ratios['first_generate_' + key]:.2f}x; with LLM() "
              f"{ratios['with_construction_' + key]:.2f}x), "
              f"second {r['second_generate_seconds']:.1f}s ({r['second_output_tok_per_s']:.1f} tok/s); in the first "
              f"call: trace {c['seconds']['trace']:.1f}s lower {c['seconds']['lower']:.1f}s "
              f"XLA {c['seconds']['xla_compile']:.1f}s, {c['xla_compiled']} compiled, "
              f"{c['persistent_cache_hits']} cache hits")
    fill = warm["idle_fill"]
    print(f"the warm process then idled {fill['seconds']:.1f}s more (fills start after "
          f"{fill['idle_before_first_fill']:.0f}s idle) while {fill['buckets_filled']} padded-out buckets compiled")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
