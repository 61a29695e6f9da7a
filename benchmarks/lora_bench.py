"""Offline throughput of one workload with LoRA adapters: what the adapter path costs, in one run.

    python benchmarks/lora_bench.py [--out benchmarks/results/lora_bench_cpu.json] [--requests 32]
    python benchmarks/lora_bench.py --model llama3-1b --out benchmarks/results/lora_bench_gpu.json  # random weights
    python benchmarks/lora_bench.py --smoke --out DIR/lora_bench_smoke.json  # tiny workload, one round (CI)

On a GPU (`benchmarks/gpu_check.sh` runs it with `--model llama3-1b --no_warmup`) set `JAX_PLATFORMS` to
anything (an empty value lets jax pick the GPU); unset, the run is on CPU.

The same greedy workload (every request the same prompt length and `--new_tokens`) runs through
`LLM.generate` on the embedded model five ways, rounds interleaved so that machine noise hits all
alike: a plain engine (LoRA off: the peer), and one engine with `enable_lora` (`--max_loras` slots of
rank `--rank` on all seven projections) serving the requests with no adapter, all with one adapter,
and spread over `--max_loras` adapters mixed in every step. Printed: tokens per second (the best round:
on a shared machine the other processes only ever slow a round down) and each one's ratio to the plain
engine in the same run; and tokens per CPU second of this process (median of the rounds; all its
threads counted), which other processes' load on a shared machine disturbs far less than wall time. The adapters are random PEFT-format
directories written here (`adapter_config.json` + `adapter_model.safetensors`, named after the
base checkpoint's Hugging Face modules), read by the server's own loader.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from serving import LLM, SamplingParams  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(cfg, path: str, rank: int, seed: int) -> str:
    """A random LoRA adapter in the PEFT format over every projection of `cfg`'s checkpoint."""
    from safetensors.numpy import save_file

    from model.families import family_for_config

    rng = np.random.default_rng(seed)
    tensors = {}
    for plan in family_for_config(cfg).checkpoint_tensors(cfg):
        module = plan.hf[:-len(".weight")]
        if module.rsplit(".", 1)[-1] in MODULES:
            out_dim, in_dim = plan.hf_shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, in_dim ** -0.5, (rank, in_dim)).astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, 0.05, (out_dim, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none", "use_rslora": False, "use_dora": False}, f)
    return path


def run(llm: LLM, prompts, sp, loras) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process, all its threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, lora_request=loras)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, tokens / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/lora_bench_cpu.json")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--max_loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8, help="adapter rank = max_lora_rank (8: PEFT's default r)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=None, help="a configs/ preset with random weights (default: the embedded "
                                                  "model)")
    ap.add_argument("--max_num_seqs", type=int, default=16)
    ap.add_argument("--no_warmup", action="store_true",
                    help="compile only the shapes the workload runs (an untimed first pass) instead of every "
                         "bucket: a bigger model's warm-up takes longer than its timing")
    ap.add_argument("--smoke", action="store_true", help="4 requests of 8 new tokens, one round, no warm-up (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.new_tokens, args.rounds, args.max_num_seqs, args.no_warmup = 4, 8, 1, 4, True
    load_before = os.getloadavg()
    engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(256, args.max_num_seqs),
                  page_size=16, min_token_bucket=16, min_context_bucket=128, max_model_len=128,
                  enable_prefix_caching=False)
    model = {}
    if args.model is not None:
        import jax

        from model.families import config_by_name
        from model.params import init_params

        cfg = config_by_name(args.model)
        model = dict(config=cfg, params=init_params(cfg, jax.random.key(0)))
    warmup = not args.no_warmup
    t_start = time.perf_counter()
    plain = LLM(**engine, **model, warmup=warmup)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"adapter{i}" for i in range(args.max_loras)]
        modules = ",".join(f"{n}={write_adapter(plain.config, os.path.join(tmp, n), args.rank, i)}"
                           for i, n in enumerate(names))
        lora = LLM(**engine, **model, warmup=warmup, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
                   lora_modules=modules)
    print(f"engines built in {time.perf_counter() - t_start:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(32, 127, args.prompt_len).tolist() for _ in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    cases = {"plain engine (LoRA off)": (plain, None), "LoRA on, base model only": (lora, None),
             "one adapter": (lora, names[0]),
             f"{args.max_loras} adapters mixed": (lora, [names[i % args.max_loras] for i in range(args.requests)])}
    # Anything the workload compiles, compiled before timing: the whole batch (its prefill chunks and full
    # decode rows) for a few tokens.
    first = SamplingParams(temperature=0.0, max_tokens=min(4, args.new_tokens), ignore_eos=True)
    for llm, loras in cases.values():
        llm.generate(prompts, first, lora_request=loras)
    print(f"first pass (compiles) done at {time.perf_counter() - t_start:.1f} s", flush=True)
    rates = {name: [] for name in cases}
    cpu_rates = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (llm, loras) in cases.items():
            wall_rate, cpu_rate = run(llm, prompts, sp, loras)
            rates[name].append(wall_rate)
            cpu_rates[name].append(cpu_rate)
    plain_name = "plain engine (LoRA off)"
    peer, peer_cpu = max(rates[plain_name]), statistics.median(cpu_rates[plain_name])
    rows = {}
    for name, values in rates.items():
        best, cpu = max(values), statistics.median(cpu_rates[name])
        rows[name] = {"tokens_per_second": round(best, 1), "ratio_to_plain": round(best / peer, 3),
                      "tokens_per_cpu_second": round(cpu, 1), "cpu_ratio_to_plain": round(cpu / peer_cpu, 3),
                      "rounds_tokens_per_second": [round(v, 1) for v in values],
                      "rounds_tokens_per_cpu_second": [round(v, 1) for v in cpu_rates[name]]}
        print(f"{name:28s} {best:9.1f} tok/s {best / peer:6.3f}x plain | {cpu:9.1f} tok/CPU-s {cpu / peer_cpu:6.3f}x plain",
              flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "platform": __import__("jax").default_backend(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
              "model": args.model or "embedded default (configs/tiny.json)", "engine": engine, "requests": args.requests,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "max_loras": args.max_loras,
              "rank": args.rank, "target_modules": list(MODULES), "rows": rows,
              "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
