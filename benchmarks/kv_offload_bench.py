"""Multi-turn chat whose KV working set is about 3x the device pool, with and without the host KV tier.

    python benchmarks/kv_offload_bench.py [--out benchmarks/results/kv_offload_cpu.json] [--quick]

Model: a Llama shape with random fp32 weights (vocab 512, hidden 512, 8 layers,
8 heads, 2 KV heads, head dim 64, intermediate 1536); 16-token pages.

Workload: `--conversations` chats of `--turns` turns. A turn's prompt is the
whole conversation so far (earlier prompts and replies) plus `--user_tokens`
new tokens; the reply is `--reply_tokens` greedy tokens. Turns are served in
waves of `--concurrency` conversations, round-robin over the conversations, so
each conversation comes back to its history after every other one has pushed
it out of the device pool (`--num_pages`, about a third of the final working
set). Each request's TTFT is from its submission to the step that returns its
first token.

Two engines over the same weights, in one process, compiled before timing
(`Engine.warm_up`): the plain engine (a prefix hit only while a page is still
in the device pool) and the same engine with a host tier big enough for the
working set (`kv_offload_bytes`). They alternate for `--rounds` rounds; each
round is the whole workload on a fresh prefix cache; each keeps its best round.
Recorded: TTFT p50 / p90, output and total token throughput, prefix hit rate,
the tier's pages offloaded and restored, and the ratios tier / plain. Then
the cost per page of the two ways back, measured in the same run: restoring
`--probe_pages` pages from the host pool (read, scatter, wait) and recomputing
them (a fresh prompt of that many pages, prefilled and its first token drawn).

Last, preemption (`--preempt_requests` requests of `--preempt_prompt` prompt
and `--preempt_tokens` greedy tokens at once, in a pool of `--preempt_pages`
pages that holds a few of them: sequences are preempted again and again),
served with `preemption_mode` recompute (no tier), swap and auto (with the
tier), alternating over `--rounds`: wall time, throughput, preemptions by mode,
pages restored, and whether the tokens agree.

CPU numbers on a shared machine are noisy: the JSON records the load average.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.params import init_params  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.features.host_kv_tier import HostKVTier  # noqa: E402
from serving.features import kv_pages  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                  num_kv_heads=2, head_dim=64, rope_theta=10000.0, dtype="float32", max_position_embeddings=2048,
                  bos_token_id=1, eos_token_ids=(2,))


def build(params, args, offload: bool) -> LLM:
    return LLM(config=CFG, params=params, page_size=16, num_pages=args.num_pages, max_model_len=args.max_model_len,
               max_num_seqs=args.concurrency, max_num_batched_tokens=args.budget, min_token_bucket=16,
               kv_offload_bytes=args.host_bytes if offload else 0)


def conversation_turns(args) -> list[list[list[int]]]:
    """Each conversation's user messages (token ids), seeded."""
    rng = random.Random(0)
    return [[[rng.randrange(3, CFG.vocab_size) for _ in range(args.user_tokens)] for _ in range(args.turns)]
            for _ in range(args.conversations)]


def serve(llm, messages, args) -> dict:
    """The whole chat workload once; TTFTs, token counts, wall time."""
    engine = llm.engine
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    history = [[1] for _ in messages]
    ttfts, prompt_tokens, output_tokens = [], 0, 0
    st0 = engine.stats()
    t_start = time.perf_counter()
    for turn in range(args.turns):
        for first in range(0, len(messages), args.concurrency):
            wave = range(first, min(first + args.concurrency, len(messages)))
            submitted = {}
            for c in wave:
                prompt = history[c] + messages[c][turn]
                rid = f"c{c}t{turn}"
                engine.add_request(rid, prompt, params, stream=True)
                submitted[rid] = (c, prompt, time.perf_counter())
                prompt_tokens += len(prompt)
            seen = set()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in seen and out.outputs and out.outputs[0].token_ids:
                        seen.add(out.request_id)
                        ttfts.append(time.perf_counter() - submitted[out.request_id][2])
                    if out.finished:
                        c, prompt, _ = submitted[out.request_id]
                        reply = list(out.outputs[0].token_ids)
                        history[c] = prompt + reply
                        output_tokens += len(reply)
    seconds = time.perf_counter() - t_start
    st1 = engine.stats()
    queried = st1.prefix_cache_queried_tokens - st0.prefix_cache_queried_tokens
    hits = st1.prefix_cache_hit_tokens - st0.prefix_cache_hit_tokens
    out = {"seconds": seconds, "requests": len(ttfts), "ttft_p50_s": float(np.percentile(ttfts, 50)),
           "ttft_p90_s": float(np.percentile(ttfts, 90)), "output_tok_per_s": output_tokens / seconds,
           "total_tok_per_s": (prompt_tokens + output_tokens) / seconds, "prompt_tokens": prompt_tokens,
           "prefix_hit_rate": hits / queried if queried else 0.0, "preemptions": st1.num_preemptions
           - st0.num_preemptions, "histories_tokens": sum(len(h) for h in history)}
    if st1.host_kv is not None:
        out.update(pages_offloaded=st1.host_kv.pages_offloaded - st0.host_kv.pages_offloaded,
                   pages_restored=st1.host_kv.pages_restored - st0.host_kv.pages_restored,
                   host_pages_used=st1.host_kv.used_pages)
    return out


def restore_vs_recompute(plain, tiered, args) -> dict:
    """Seconds per page: restoring `probe_pages` pages from the host pool into the device pool (read, scatter,
    wait), and recomputing them (a fresh prompt of that many pages plus one token, first token drawn)."""
    n, ps = args.probe_pages, 16
    tier, runner = tiered.engine.part(HostKVTier), tiered.engine.runner
    digests = list(tier.pool.index)[:n]
    assert len(digests) == n, "the workload left too few pages in the host pool to probe"
    pages = list(range(n))  # the engine is idle: overwriting its pages only costs cached prefixes
    slots = kv_pages.token_slots(pages, ps, 0, n * ps)
    restore = []
    for _ in range(args.probe_repeats + 1):
        t0 = time.perf_counter()
        kv_pages.write(runner, slots, tier.pool.read(digests))
        jax.block_until_ready(runner.cache)
        restore.append(time.perf_counter() - t0)
    tiered.engine.reset_prefix_cache()  # its pages hold other K/V now
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    recompute = []
    for _ in range(args.probe_repeats + 1):
        prompt = [1] + [rng.randrange(3, CFG.vocab_size) for _ in range(n * ps)]
        t0 = time.perf_counter()
        plain.generate([prompt], params)
        recompute.append(time.perf_counter() - t0)
    r, c = min(restore[1:]), min(recompute[1:])  # the first of each compiles or warms caches
    return {"pages": n, "restore_s_per_page": r / n, "recompute_s_per_page": c / n, "recompute_over_restore": c / r}


def preemption(params, args) -> dict:
    """The preemption workload under recompute / swap / auto; best round of each, and whether tokens agree."""
    rng = random.Random(2)
    prompts = [[1] + [rng.randrange(3, CFG.vocab_size) for _ in range(args.preempt_prompt - 1)]
               for _ in range(args.preempt_requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.preempt_tokens, ignore_eos=True)
    modes = {"recompute": dict(kv_offload_bytes=0), "swap": dict(kv_offload_bytes=args.host_bytes,
                                                                   preemption_mode="swap"),
             "auto": dict(kv_offload_bytes=args.host_bytes, preemption_mode="auto")}
    engines = {}
    for mode, extra in modes.items():
        engines[mode] = LLM(config=CFG, params=params, page_size=16, num_pages=args.preempt_pages,
                            max_model_len=args.max_model_len, max_num_seqs=args.preempt_requests,
                            max_num_batched_tokens=args.budget, min_token_bucket=16, **extra)
        engines[mode].engine.warm_up()
    runs, outputs = {m: [] for m in modes}, {}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            e = llm.engine
            e.reset_prefix_cache()
            st0 = e.stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            seconds = time.perf_counter() - t0
            st1 = e.stats()
            outputs[mode] = [list(o.outputs[0].token_ids) for o in outs]
            r = {"seconds": seconds, "output_tok_per_s": len(prompts) * args.preempt_tokens / seconds,
                 "preemptions": st1.num_preemptions - st0.num_preemptions}
            if st1.host_kv is not None:
                r.update(swapped=st1.host_kv.preemptions_swap - st0.host_kv.preemptions_swap,
                         recomputed=st1.host_kv.preemptions_recompute - st0.host_kv.preemptions_recompute,
                         pages_restored=st1.host_kv.pages_restored - st0.host_kv.pages_restored,
                         measured_copy_bytes_per_s=st1.host_kv.bandwidth_bytes_per_s,
                         measured_recompute_tokens_per_s=st1.host_kv.recompute_tokens_per_s)
            runs[mode].append(r)
    best = {m: min(r, key=lambda x: x["seconds"]) for m, r in runs.items()}
    return {"workload": {k: getattr(args, k) for k in ("preempt_requests", "preempt_prompt", "preempt_tokens",
                                                        "preempt_pages")},
            **best, "all_rounds": runs,
            "tokens_agree": all(outputs[m] == outputs["recompute"] for m in modes),
            "throughput_swap_over_recompute": best["swap"]["output_tok_per_s"]
            / best["recompute"]["output_tok_per_s"],
            "throughput_auto_over_recompute": best["auto"]["output_tok_per_s"]
            / best["recompute"]["output_tok_per_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "kv_offload_cpu.json"))
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--user_tokens", type=int, default=64)
    p.add_argument("--reply_tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num_pages", type=int, default=64, help="device pool (16-token pages)")
    p.add_argument("--host_bytes", type=int, default=256 * 2**20, help="host tier budget")
    p.add_argument("--max_model_len", type=int, default=512)
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe_pages", type=int, default=16)
    p.add_argument("--probe_repeats", type=int, default=3)
    p.add_argument("--preempt_requests", type=int, default=8)
    p.add_argument("--preempt_prompt", type=int, default=32)
    p.add_argument("--preempt_tokens", type=int, default=224)
    p.add_argument("--preempt_pages", type=int, default=48, help="device pool of the preemption workload")
    p.add_argument("--quick", action="store_true", help="3 turns, 1 round (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.rounds = 3, 1
    need = 1 + args.turns * (args.user_tokens + args.reply_tokens)
    assert need <= args.max_model_len, f"the last turn needs {need} tokens > max_model_len"

    params = init_params(CFG, jax.random.key(0))
    engines = {"plain": build(params, args, False), "host_tier": build(params, args, True)}
    for llm in engines.values():
        llm.engine.warm_up()
    messages = conversation_turns(args)
    load_before = os.getloadavg()
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            runs[name].append(serve(llm, messages, args))
    best = {name: min(r, key=lambda x: x["seconds"]) for name, r in runs.items()}
    plain, tier = best["plain"], best["host_tier"]
    probe = restore_vs_recompute(engines["plain"], engines["host_tier"], args)
    del engines
    preempt = preemption(params, args)
    pool_tokens = args.num_pages * 16
    result = {
        "benchmark": "kv_offload_bench", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "backend": jax.default_backend(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "model": {k: getattr(CFG, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                "num_heads", "num_kv_heads", "head_dim")},
        "workload": {k: getattr(args, k) for k in ("conversations", "turns", "user_tokens", "reply_tokens",
                                                    "concurrency", "num_pages", "host_bytes", "rounds")},
        "device_pool_tokens": pool_tokens,
        "working_set_tokens": plain["histories_tokens"],
        "working_set_over_pool": plain["histories_tokens"] / pool_tokens,
        "plain": plain, "host_tier": tier, "all_rounds": runs,
        "ratios": {"ttft_p50_plain_over_tier": plain["ttft_p50_s"] / tier["ttft_p50_s"],
                   "ttft_p90_plain_over_tier": plain["ttft_p90_s"] / tier["ttft_p90_s"],
                   "throughput_tier_over_plain": tier["total_tok_per_s"] / plain["total_tok_per_s"]},
        "restore_vs_recompute": probe,
        "preemption": preempt,
    }
    print(f"working set {result['working_set_tokens']} tokens = {result['working_set_over_pool']:.1f}x the device "
          f"pool of {pool_tokens}")
    print(f"{'':10} {'TTFT p50':>10} {'TTFT p90':>10} {'tok/s':>9} {'hit rate':>9}")
    for name, r in (("plain", plain), ("host tier", tier)):
        print(f"{name:10} {r['ttft_p50_s'] * 1e3:>8.1f}ms {r['ttft_p90_s'] * 1e3:>8.1f}ms "
              f"{r['total_tok_per_s']:>9.0f} {r['prefix_hit_rate']:>9.2f}")
    print("ratios:", {k: round(v, 2) for k, v in result["ratios"].items()})
    print(f"per page: restore {probe['restore_s_per_page'] * 1e3:.3f} ms, recompute "
          f"{probe['recompute_s_per_page'] * 1e3:.3f} ms ({probe['recompute_over_restore']:.1f}x)")
    print("preemption:", {m: (round(preempt[m]["output_tok_per_s"], 1), preempt[m]["preemptions"])
                          for m in ("recompute", "swap", "auto")}, "tokens agree:", preempt["tokens_agree"])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
