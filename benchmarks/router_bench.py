"""KV-aware routing against round-robin on a multi-turn chat workload, over local worker replicas.

    python benchmarks/router_bench.py --num_workers 2 --conversations 8 --turns 5 \\
        --result_file benchmarks/results/router_bench_cpu.json

Starts `--num_workers` `python -m serving.server` replicas (the embedded model
unless `--worker_flags` says otherwise), then, for each policy in turn, a
`python -m serving.router` in front of them, and runs the same shape of
workload through it: `--conversations` chats at once, each `--turns` turns
long, every turn resending the whole conversation so far plus a new user
message (the assistant's answers included), streamed. Each policy gets its own
conversation texts (a seed per policy), so one policy never finds the other's
prefixes in the workers' caches; the order of the policies alternates over
`--rounds`.

Reported per policy: TTFT p50 / p99 as the client sees it (request sent to the
first SSE chunk), the prefix hit rate the workers measured (their
`prefix_cache_hits / prefix_cache_queries` deltas), the router's own estimate
(`router_prefix_hit_rate`), and how the requests spread over the workers;
then kv_aware / round_robin ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from serving.cluster.local_fleet import LocalFleet  # noqa: E402

WORDS = ("ridge trail summit valley river stone pine cloud wind path camp map rope snow peak lake "
         "bridge forest meadow cliff").split()


def _sum_metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _worker_counters(client, workers) -> dict[str, tuple[float, float]]:
    out = {}
    for w in workers:
        text = (await client.get(w.url + "/metrics")).text
        out[w.url] = (_sum_metric(text, "vllm:prefix_cache_hits_total"),
                      _sum_metric(text, "vllm:prefix_cache_queries_total"))
    return out


async def _conversation(client, url: str, rng: random.Random, turns: int, words: int, max_tokens: int,
                        ttfts: list[float]) -> None:
    messages = []
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))})
        body = {"model": "fleet", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        first, text = None, []
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    text.append(c.get("delta", {}).get("content") or "")
        ttfts.append(first)
        messages.append({"role": "assistant", "content": "".join(text)})


async def run_policy(fleet: LocalFleet, policy: str, seed: int, args) -> dict:
    router = fleet.start_router([f"--policy={policy}", f"--page_size={args.page_size}", "--check_interval_s=0.5"])
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            before = await _worker_counters(client, fleet.workers)
            ttfts: list[float] = []
            t0 = time.perf_counter()
            await asyncio.gather(*(
                _conversation(client, router.url, random.Random(seed * 1000 + i), args.turns, args.words,
                              args.max_tokens, ttfts) for i in range(args.conversations)))
            elapsed = time.perf_counter() - t0
            after = await _worker_counters(client, fleet.workers)
            rtext = (await client.get(router.url + "/metrics")).text
    finally:
        fleet.stop_router()
    hits = sum(after[u][0] - before[u][0] for u in after)
    queries = sum(after[u][1] - before[u][1] for u in after)
    spread = {m.group(1): int(float(m.group(2))) for m in
              re.finditer(r'ridgeline:router_requests_routed_total\{policy="\w+",worker="([^"]+)"\} (\S+)', rtext)}
    est = re.search(r"^ridgeline:router_prefix_hit_rate (\S+)$", rtext, re.M)
    return {"policy": policy, "requests": len(ttfts), "elapsed_s": elapsed,
            "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
            "ttft_mean_s": float(np.mean(ttfts)), "worker_prefix_hit_rate": hits / queries if queries else 0.0,
            "router_prefix_hit_rate": float(est.group(1)) if est else None,
            "requests_per_worker": sorted(spread.values(), reverse=True)}


def _table(rows: list[dict]) -> str:
    by = {}
    for r in rows:  # mean over rounds
        by.setdefault(r["policy"], []).append(r)
    keys = [("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"),
            ("worker_prefix_hit_rate", "prefix hit rate (workers)"),
            ("router_prefix_hit_rate", "prefix hit rate (router index)"), ("elapsed_s", "workload wall time (s)")]
    agg = {p: {k: float(np.mean([r[k] for r in rs])) for k, _ in keys} for p, rs in by.items()}
    kv, rr = agg.get("kv_aware"), agg.get("round_robin")
    lines = ["| metric | kv_aware | round_robin | kv_aware / round_robin |", "|---|---|---|---|"]
    for k, label in keys:
        ratio = f"{kv[k] / rr[k]:.2f}" if kv and rr and rr[k] else "-"
        lines.append(f"| {label} | {kv[k]:.3f} | {rr[k]:.3f} | {ratio} |")
    spreads = {p: [r["requests_per_worker"] for r in rs] for p, rs in by.items()}
    lines.append(f"| requests per worker | {spreads['kv_aware']} | {spreads['round_robin']} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_workers", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--words", type=int, default=8, help="words per user message")
    ap.add_argument("--max_tokens", type=int, default=16, help="tokens per assistant answer")
    ap.add_argument("--rounds", type=int, default=1, help="runs per policy, the order alternating")
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--worker_flags", default="--max_num_seqs=8 --max_num_batched_tokens=32 --min_token_bucket=32 "
                                               "--max_model_len=512 --attention_backend=reference")
    ap.add_argument("--compilation_cache_dir", default=os.path.join(tempfile.gettempdir(), "ridgeline-router-bench"))
    ap.add_argument("--result_file", default=os.path.join(ROOT, "benchmarks", "results", "router_bench_cpu.json"))
    args = ap.parse_args()

    flags = args.worker_flags.split() + [f"--page_size={args.page_size}"]
    rows = []
    with tempfile.TemporaryDirectory() as logs, LocalFleet(logs, args.compilation_cache_dir, flags) as fleet:
        t0 = time.perf_counter()
        fleet.start_workers(args.num_workers, timeout_s=1800)
        print(f"{args.num_workers} workers up in {time.perf_counter() - t0:.1f} s", flush=True)
        for rnd in range(args.rounds):
            order = ("kv_aware", "round_robin") if rnd % 2 == 0 else ("round_robin", "kv_aware")
            for policy in order:
                row = asyncio.run(run_policy(fleet, policy, seed=2 * rnd + (policy == "round_robin") + 1, args=args))
                row["round"] = rnd
                rows.append(row)
                print(json.dumps(row), flush=True)
    table = _table(rows)
    print(table)
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "args": vars(args),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_at_end": os.getloadavg()},
              "rows": rows, "table_markdown": table}
    os.makedirs(os.path.dirname(args.result_file), exist_ok=True)
    with open(args.result_file, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.result_file}")


if __name__ == "__main__":
    main()
