"""Load generator for any OpenAI-compatible server, reporting what `vllm bench serve` reports.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --dataset-name random \
        --num-prompts 200 --request-rate 8 --random-input-len 128 --random-output-len 64 \
        --goodput ttft:500 tpot:50 --result-file benchmarks/results/serve_bench.json

Requests are streamed (SSE) so time to first token and inter-token latency are
seen as a client sees them. Arrivals are a gamma process (Poisson at
`--burstiness 1`) at `--request-rate` requests/s, or all at once with `inf`;
`--max-concurrency` caps in-flight requests either way.

Datasets (seeded, so two servers can be given the same workload):
  random          /v1/completions; input and output lengths uniform in
                  len * [1 - range_ratio, 1 + range_ratio]; the prompt is random words.
  synthetic-chat  /v1/chat/completions; a system and a user message whose
                  lengths, like those of real chat traffic, are log-normal
                  (a long right tail around a modest median).
Lengths are in tokens. Without `--tokenizer` the prompt's token count is only
estimated from `--chars-per-token` when the text is built; the reported input
token totals always come from the server's `usage`. `ignore_eos` is sent so
every request generates its requested length (servers without that vLLM
extension ignore it, and their output lengths are counted as they come).

`--peer-base-url` runs the identical workload against a second server right
after the first and prints both results and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

_WORDS = (
    "the of and to in is it that for on with as was at by be this from or have an not are but had they which one "
    "you were all we can her has there been if more when will would who so no time out up about into them than "
    "model token cache page batch request server latency stream kernel memory layer weight answer question value "
    "river stone light paper garden window morning winter music number letter system table orange seven quiet"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[dict]  # text for completions, messages for chat
    prompt_len: int  # the intended length in tokens (exact with --tokenizer)
    output_len: int
    endpoint: str  # "completions" or "chat"


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # from usage when the server reports it
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)


# --- datasets ---------------------------------------------------------------------------------


class _LengthModel:
    """Builds text of a target token length, exactly with a tokenizer, else from chars/token."""

    def __init__(self, tokenizer=None, chars_per_token: float = 4.0):
        self.tok = tokenizer
        self.cpt = chars_per_token

    def text(self, rng: random.Random, tokens: int) -> str:
        words = []
        chars = 0
        target = max(1, int(tokens * self.cpt)) if self.tok is None else None
        while True:
            w = rng.choice(_WORDS)
            words.append(w)
            chars += len(w) + 1
            if self.tok is None and chars >= target:
                return " ".join(words)[:target]
            if self.tok is not None and chars >= tokens:  # cheap pre-check; a word is >= 1 token
                ids = self.tok.encode(" ".join(words), add_special_tokens=False)
                if len(ids) >= tokens:
                    return self.tok.decode(ids[:tokens])


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                   lengths: _LengthModel) -> list[BenchRequest]:
    rng = random.Random(seed)

    def draw(length):
        lo, hi = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(n):
        p, o = draw(input_len), draw(output_len)
        out.append(BenchRequest(lengths.text(rng, p), p, o, "completions"))
    return out


def synthetic_chat_dataset(n: int, input_median: int, output_median: int, sigma: float, max_input: int,
                           max_output: int, seed: int, lengths: _LengthModel) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(min(max_input, max(4, rng.lognormvariate(math.log(input_median), sigma))))
        o = int(min(max_output, max(1, rng.lognormvariate(math.log(output_median), sigma * 0.8))))
        system = "You are a helpful assistant."
        user = lengths.text(rng, max(1, p - 8))
        out.append(BenchRequest([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                p, o, "chat"))
    return out


# --- one request ------------------------------------------------------------------------------


def _payload(req: BenchRequest, model: str, ignore_eos: bool) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if req.endpoint == "chat":
        body["messages"] = req.prompt
        return "/v1/chat/completions", body
    body["prompt"] = req.prompt
    return "/v1/completions", body


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(client, base_url: str, model: str, req: BenchRequest, ignore_eos: bool) -> RequestResult:
    path, body = _payload(req, model, ignore_eos)
    res = RequestResult(prompt_len=req.prompt_len)
    res.start = time.perf_counter()
    last = res.start
    chunks = 0
    try:
        async with client.stream("POST", base_url.rstrip("/") + path, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = json.dumps(chunk["error"])[:300]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.prompt_len = chunk["usage"].get("prompt_tokens", res.prompt_len)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if _chunk_text(chunk):
                    if chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    res.chunk_times.append(now)
                    chunks += 1
                    last = now
        res.latency = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks
        res.success = chunks > 0 or res.output_tokens > 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


# --- the run ----------------------------------------------------------------------------------


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds to wait before each of the n-1 later requests: gamma-distributed with mean 1/rate and
    shape `burstiness` (1 = Poisson arrivals; < 1 burstier, > 1 more even); all zero at rate inf."""
    if rate == float("inf") or n < 2:
        return np.zeros(max(0, n - 1))
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)


async def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yields request indices 0..n-1, sleeping the arrival gaps between them."""
    gaps = arrival_gaps(n, rate, burstiness, rng)
    for i in range(n):
        yield i
        if i < len(gaps) and gaps[i] > 0:
            await asyncio.sleep(gaps[i])


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], *, request_rate: float = float("inf"),
                        burstiness: float = 1.0, max_concurrency: int | None = None, ignore_eos: bool = True,
                        seed: int = 0, timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Sends every request and returns (per-request results in order, duration in seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1,
                          max_keepalive_connections=max_concurrency or len(requests) or 1)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult | None] = [None] * len(requests)
    rng = np.random.default_rng(seed)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def one(i):
            if sem is None:
                results[i] = await send_request(client, base_url, model, requests[i], ignore_eos)
                return
            async with sem:
                results[i] = await send_request(client, base_url, model, requests[i], ignore_eos)

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), request_rate, burstiness, rng):
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (SLOs in ms on the command line)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad --goodput entry {item!r}; expected ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value) / 1000.0
    return slos


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None,
              percentiles=(50, 90, 99)) -> dict:
    """The numbers `vllm bench serve` prints (times in ms), plus goodput under the SLOs."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    m = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }
    for name, xs in series.items():
        arr = np.asarray(xs, dtype=np.float64) * 1000.0
        m[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else 0.0
        m[f"median_{name}_ms"] = float(np.median(arr)) if arr.size else 0.0
        m[f"std_{name}_ms"] = float(arr.std()) if arr.size else 0.0
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p)) if arr.size else 0.0
    # Peak output throughput: generated chunks per one-second window.
    times = sorted(t for r in ok for t in r.chunk_times)
    if times:
        secs = np.floor(np.asarray(times) - times[0]).astype(int)
        m["max_output_tokens_per_s"] = float(np.bincount(secs).max())
    else:
        m["max_output_tokens_per_s"] = 0.0
    if slos:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            vals = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            good += all(vals[k] <= v for k, v in slos.items())
        m["request_goodput"] = good / duration if duration else 0.0
        m["goodput_slos_ms"] = {k: v * 1000.0 for k, v in slos.items()}
    return m


def format_report(m: dict, *, max_concurrency=None, request_rate=float("inf"), title="Serving Benchmark Result",
                  percentiles=(50, 90, 99)) -> str:
    """The familiar `vllm bench serve` block."""
    w = 40
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label, value, fmt="{:<10}"):
        lines.append(f"{label:<{w}}" + fmt.format(value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", "inf" if request_rate == float("inf") else f"{request_rate:.2f}")
    row("Benchmark duration (s):", m["duration"], "{:<10.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], "{:<10.2f}")
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", m["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], "{:<10.2f}")
    sections = [("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")]
    for key, header, short in sections:
        lines.append(f"{header:-^50}")
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", m[f"median_{key}_ms"], "{:<10.2f}")
        for p in percentiles:
            if p != 50:
                row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"], "{:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def build_dataset(args) -> list[BenchRequest]:
    tokenizer = None
    if args.tokenizer:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    lengths = _LengthModel(tokenizer, args.chars_per_token)
    if args.dataset_name == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed, lengths)
    return synthetic_chat_dataset(args.num_prompts, args.chat_input_median, args.chat_output_median,
                                  args.chat_sigma, args.chat_max_input, args.chat_max_output, args.seed, lengths)


async def _served_model(base_url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(base_url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def bench_one(args, base_url: str, model: str | None, requests, percentiles) -> dict:
    model = model or asyncio.run(_served_model(base_url))
    slos = parse_goodput(args.goodput)
    # One request first, so connection setup and any lazy work on the server stay out of the numbers.
    warm, _ = asyncio.run(run_benchmark(base_url, model, requests[:1], ignore_eos=not args.no_ignore_eos))
    if not warm[0].success:
        raise SystemExit(f"the warm-up request to {base_url} failed: {warm[0].error}")
    results, duration = asyncio.run(run_benchmark(
        base_url, model, requests, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=not args.no_ignore_eos, seed=args.seed))
    m = summarize(results, duration, slos, percentiles)
    m.update(base_url=base_url, model=model)
    m["per_request"] = [
        {"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft": r.ttft, "latency": r.latency,
         "success": r.success} for r in results
    ]
    return m


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--dataset-name", choices=["random", "synthetic-chat"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--chat-input-median", type=int, default=96)
    p.add_argument("--chat-output-median", type=int, default=128)
    p.add_argument("--chat-sigma", type=float, default=0.9)
    p.add_argument("--chat-max-input", type=int, default=1024)
    p.add_argument("--chat-max-output", type=int, default=512)
    p.add_argument("--tokenizer", default=None, help="checkpoint dir whose tokenizer makes prompt lengths exact")
    p.add_argument("--chars-per-token", type=float, default=4.0)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms: ttft:500 tpot:50 e2el:2000")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-base-url", default=None, help="a second server given the identical workload")
    p.add_argument("--peer-model", default=None)
    p.add_argument("--note", default=None, help="free text stored in the JSON (e.g. how the servers were started)")
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)

    percentiles = tuple(float(x) for x in args.metric_percentiles.split(","))
    requests = build_dataset(args)
    runs = {"server": bench_one(args, args.base_url, args.model, requests, percentiles)}
    if args.peer_base_url:
        runs["peer"] = bench_one(args, args.peer_base_url, args.peer_model, requests, percentiles)
    for name, m in runs.items():
        print(format_report(m, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                            title=f"Serving Benchmark Result ({name}: {m['base_url']})", percentiles=percentiles))
    ratios = {}
    if "peer" in runs:
        a, b = runs["server"], runs["peer"]
        for key in ("request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms"):
            ratios[key] = a[key] / b[key] if b[key] else None
            print(f"{'ratio server/peer ' + key + ':':<50}{ratios[key] if ratios[key] is None else round(ratios[key], 3)}")
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "note": args.note,
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
        "runs": runs,
        "ratios": ratios,
    }
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.result_file}")
    return result


if __name__ == "__main__":
    main()
