"""Full-model figures on one GPU: a Llama-3-8B-shaped model with random bf16 weights.

    python benchmarks/gpu_model_bench.py [--out DIR] [--budget-s 420]
    python benchmarks/gpu_model_bench.py --smoke          # CPU, tiny shapes: checks the script runs

Sections, in one process, each skipped (and said so in the JSON) once the time
budget is spent, so the whole run fits the GPU check's 8 minutes:
  1. ceilings measured in the same run: device read bandwidth (a jitted sum
     over a large array) and the bf16 matmul rate (a large square product);
     the H200's data-sheet peaks (4.8 TB/s, 989 dense bf16 TFLOP/s) are used
     for MBU/MFU when the device is an H200, the measured ceilings otherwise;
  2. decode: the serving step (forward + sampling, cache donated) at batch 1,
     16, 64 and 256, every sequence with a 1,024-token context; tokens/s and
     MBU = (weights read + K/V read) per step x steps/s / peak bandwidth;
  3. prefill: one 2,048-token prompt in one step; MFU = model FLOPs (matmuls
     and causal attention) per second / peak FLOP/s;
  4. the engine (`LLM` with continuous batching) on a synthetic chat workload
     (log-normal prompt and output lengths, medians 96 and 128, as
     benchmarks/serve_bench.py's synthetic-chat), output tokens/s, stopped
     at its share of the budget; then 32 chat requests run with overlapped
     scheduling and one step at a time, alternating, each mode's best kept.

Writes OUT/gpu_model_bench.json (gpu_model_bench_smoke.json with --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model.cache import init_cache  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.families import config_by_name, kv_bytes_per_token, num_params  # noqa: E402
from model.params import init_params, param_bytes  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.core.input_batch import StepShape  # noqa: E402
from serving.core.model_runner import _step_jit  # noqa: E402

H200_PEAKS = {"bandwidth": 4.8e12, "bf16_flops": 989e12}
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, rope_theta=10000.0, dtype="bfloat16", max_position_embeddings=1024,
                   bos_token_id=1, eos_token_ids=(2,))
PAGE = 16


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def best_time(f, repeats):
    f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def measured_ceilings(smoke: bool) -> dict:
    n = (16 if smoke else 4096) * 2**20 // 2
    x = jnp.ones((n,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    bw = x.nbytes / best_time(lambda: total(x).block_until_ready(), 10)
    del x
    m = 256 if smoke else 8192
    a = jnp.ones((m, m), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    flops = 2 * m**3 / best_time(lambda: mm(a).block_until_ready(), 10)
    return {"read_bandwidth": bw, "bf16_matmul_flops": flops}


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights multiplied per token in the layers (the logits head is counted per logit row)."""
    e, h, k, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return cfg.num_layers * (e * d * (2 * h + 2 * k) + 3 * e * f)


def weight_bytes_per_step(cfg: LlamaConfig, params) -> int:
    """Everything but the embedding table, of which one row per token is read."""
    return param_bytes(params) - params.embed.nbytes + cfg.hidden_size * params.embed.dtype.itemsize


def step_inputs(seqs, T, S, P, num_pages, rng):
    """ibuf/fbuf for sequences given as (q_len, kv_len), each on its own consecutive pages."""
    shape = StepShape(T, S, P)
    ibuf, fbuf, v = shape.empty(num_pages * PAGE)
    t = page = 0
    for i, (q, kv) in enumerate(seqs):
        n = -(-kv // PAGE)
        table = np.arange(page, page + n)
        page += n
        v["block_tables"][i, :n] = table
        pos = np.arange(kv - q, kv)
        v["positions"][t:t + q] = pos
        v["slots"][t:t + q] = table[pos // PAGE] * PAGE + pos % PAGE
        v["tokens"][t:t + q] = rng.integers(3, 500, q)
        v["logits_indices"][i] = t + q - 1
        t += q
        v["cu_q_lens"][i + 1:] = t
        v["kv_lens"][i] = kv
    v["num_seqs"][0] = len(seqs)
    assert page <= num_pages
    return shape, ibuf, fbuf


class StepTimer:
    """Runs the serving step on given inputs, carrying the donated cache along."""

    def __init__(self, cfg, params, num_pages):
        self.cfg, self.params = cfg, params
        self.cache = jax.device_put(init_cache(cfg, num_pages, PAGE), jax.devices()[0])

    def time(self, shape, ibuf, fbuf, repeats):
        ibuf, fbuf = jax.device_put((ibuf, fbuf), jax.devices()[0])

        def run():
            self.cache, ids, _, _, _, _ = _step_jit(self.params, self.cache, ibuf, fbuf, cfg=self.cfg, backend="auto",
                                              shape=shape)
            np.asarray(ids)  # the engine's one sync per step

        t = time.perf_counter()
        run()
        first = time.perf_counter() - t
        return best_time(run, repeats), first


def chat_workload(n, seed, max_input, max_output):
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        p = int(min(max_input, max(4, rng.lognormvariate(math.log(96), 0.9))))
        o = int(min(max_output, max(1, rng.lognormvariate(math.log(128), 0.9 * 0.8))))
        jobs.append(([1] + [rng.randrange(3, 500) for _ in range(p - 1)], o))
    return jobs


def engine_throughput(cfg, params, smoke, deadline):
    max_seqs, budget = (4, 64) if smoke else (256, 2048)
    max_len = 256 if smoke else 2048
    jobs = chat_workload(8 if smoke else 256, 0, max_len // 2, max_len // 4)
    # Few step shapes (token buckets from 256, context buckets of half and all of
    # max_model_len), all compiled by the warm-up, so the timed run compiles nothing.
    llm = LLM(config=cfg, params=params, max_num_seqs=max_seqs, max_num_batched_tokens=budget, page_size=PAGE,
              num_pages=(max_seqs * max_len if smoke else 16384 * PAGE) // PAGE, max_model_len=max_len,
              enable_prefix_caching=False, min_token_bucket=32 if smoke else 256, min_context_bucket=max_len // 2,
              compilation_cache_dir="", warmup=True)
    engine = llm.engine
    engine.stats_log.drain()
    for i, (p, o) in enumerate(jobs):
        engine.add_request(f"chat-{i}", p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    t = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests() and (time.perf_counter() < deadline or n < 10):
        engine.step()
        n += 1
    wall = time.perf_counter() - t
    steps = engine.stats_log.drain()
    gen = sum(s.num_generation_tokens for s in steps)
    prompt = sum(s.num_prompt_tokens for s in steps)
    host = sum(s.host_seconds for s in steps)
    out = {"warmup_seconds": llm.warmup_info["seconds"], "step_shapes": llm.warmup_info["shapes"],
           "requests": len(jobs), "completed": not engine.has_unfinished_requests(), "seconds": wall,
           "steps": len(steps), "output_tokens": gen, "prompt_tokens": prompt, "output_tok_per_s": gen / wall,
           "total_tok_per_s": (gen + prompt) / wall, "host_fraction": host / wall, "max_num_seqs": max_seqs,
           "max_num_batched_tokens": budget, "prompt_median": 96, "output_median": 128}
    for rid in list(engine.requests):  # what the budget cut short
        engine.abort_request(rid)
    engine.step()  # processes a step still in flight
    out["overlap"] = overlap_comparison(engine, smoke, deadline)
    return out


def overlap_comparison(engine, smoke, deadline):
    """The same small chat batch with overlapped scheduling and one step at a time, alternating
    (the engine's compiled steps serve both; the mode is switched between runs, with no step
    in flight)."""
    jobs = chat_workload(4 if smoke else 32, 1, 128 if smoke else 512, 32 if smoke else 128)
    times = {True: [], False: []}
    for _ in range(2):
        for overlap in (True, False):
            if time.perf_counter() > deadline and times[False]:
                break
            engine.overlap = overlap
            for i, (p, o) in enumerate(jobs):
                engine.add_request(f"ov-{overlap}-{len(times[overlap])}-{i}", p,
                                   SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            engine.step()
            times[overlap].append(time.perf_counter() - t)
    engine.overlap = True
    gen = sum(o for _, o in jobs)
    best = {k: min(v) for k, v in times.items() if v}
    return {"requests": len(jobs), "output_tokens": gen,
            "seconds": {"overlapped": times[True], "one_step_at_a_time": times[False]},
            "output_tok_per_s_overlapped": gen / best[True], "output_tok_per_s_one_at_a_time": gen / best[False],
            "speedup": best[False] / best[True]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script runs")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new section after this")
    args = ap.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    smoke = args.smoke
    if smoke:
        cfg = LlamaConfig(**SMOKE_SHAPE)
        batches, context, prefill, repeats = (1, 4), 64, 128, 2
    else:
        cfg = config_by_name("llama3-8b")
        batches, context, prefill, repeats = (1, 16, 64, 256), 1024, 2048, 10
    dev = jax.devices()[0]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "smoke": smoke,
              "device": getattr(dev, "device_kind", str(dev)), "platform": jax.default_backend(),
              "jax": jax.__version__, "model": {"params_billions": num_params(cfg) / 1e9, "dtype": cfg.dtype,
                                                 "layers": cfg.num_layers, "hidden": cfg.hidden_size}}
    log(f"device {result['device']}; model {num_params(cfg) / 1e9:.2f}B params {cfg.dtype}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_model_bench_smoke.json" if smoke else "gpu_model_bench.json")

    def save():  # after every section, so a hard stop keeps what was measured
        result["seconds"] = time.perf_counter() - t_start
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    ceil = measured_ceilings(smoke)
    is_h200 = "H200" in result["device"]
    peak_bw = H200_PEAKS["bandwidth"] if is_h200 else ceil["read_bandwidth"]
    peak_flops = H200_PEAKS["bf16_flops"] if is_h200 else ceil["bf16_matmul_flops"]
    result["ceilings"] = {"measured_read_bandwidth_GBps": ceil["read_bandwidth"] / 1e9,
                          "measured_bf16_matmul_TFLOPs": ceil["bf16_matmul_flops"] / 1e12,
                          "peak_bandwidth_GBps": peak_bw / 1e9, "peak_bf16_TFLOPs": peak_flops / 1e12,
                          "peaks_from": "H200 data sheet" if is_h200 else "measured in this run"}
    log(f"measured read {ceil['read_bandwidth'] / 1e9:.0f} GB/s, bf16 matmul "
        f"{ceil['bf16_matmul_flops'] / 1e12:.1f} TFLOP/s; MBU/MFU against {result['ceilings']['peaks_from']}")

    params = init_params(cfg, jax.random.key(0))
    wbytes = weight_bytes_per_step(cfg, params)
    kv_token = kv_bytes_per_token(cfg)
    ctx_pages = context // PAGE
    num_pages = max(batches) * ctx_pages + prefill // PAGE + 1
    timer = StepTimer(cfg, params, num_pages)
    rng = np.random.default_rng(0)

    decode = []
    for b in batches:
        if time.perf_counter() > deadline:
            decode.append({"batch": b, "skipped": "time budget spent"})
            continue
        shape, ibuf, fbuf = step_inputs([(1, context)] * b, b, b, ctx_pages, num_pages, rng)
        step, first = timer.time(shape, ibuf, fbuf, repeats)
        read = wbytes + b * context * kv_token
        r = {"batch": b, "context": context, "ms_per_step": step * 1e3, "tok_per_s": b / step,
             "bytes_per_step": read, "mbu": read / step / peak_bw, "first_call_s": first}
        decode.append(r)
        log(f"decode batch {b:4d} ctx {context}: {r['ms_per_step']:.2f} ms/step, {r['tok_per_s']:.0f} tok/s, "
            f"MBU {r['mbu']:.2f}")
    result["decode"] = decode
    save()

    if time.perf_counter() < deadline:
        shape, ibuf, fbuf = step_inputs([(prefill, prefill)], prefill, 16, prefill // PAGE, num_pages, rng)
        step, first = timer.time(shape, ibuf, fbuf, max(2, repeats // 2))
        attn = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * prefill * (prefill + 1) / 2
        flops = 2 * prefill * matmul_params(cfg) + 2 * cfg.hidden_size * cfg.vocab_size + attn
        result["prefill"] = {"tokens": prefill, "ms": step * 1e3, "tok_per_s": prefill / step, "flops": flops,
                             "mfu": flops / step / peak_flops, "first_call_s": first}
        log(f"prefill {prefill} tokens: {step * 1e3:.1f} ms, MFU {result['prefill']['mfu']:.2f}")
    else:
        result["prefill"] = {"skipped": "time budget spent"}
    del timer
    save()

    if time.perf_counter() < deadline - (5 if smoke else 60):  # the warm-up alone takes a while
        result["engine_chat"] = engine_throughput(cfg, params, smoke, deadline)
        e = result["engine_chat"]
        log(f"engine, synthetic chat: {e['output_tok_per_s']:.0f} output tok/s over {e['steps']} steps "
            f"({'all' if e['completed'] else 'not all'} of {e['requests']} requests finished)")
        o = e["overlap"]
        log(f"overlapped scheduling vs one step at a time, {o['requests']} requests: "
            f"{o['output_tok_per_s_overlapped']:.0f} vs {o['output_tok_per_s_one_at_a_time']:.0f} output tok/s "
            f"({o['speedup']:.3f}x)")
    else:
        result["engine_chat"] = {"skipped": "time budget spent"}
    save()
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
