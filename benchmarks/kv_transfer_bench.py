"""What shipping KV from a prefill worker to a decode worker costs, per token, next to recomputing it.

    python benchmarks/kv_transfer_bench.py                      # embedded model, prompts of 64/256/768 tokens
    python benchmarks/kv_transfer_bench.py --lengths 32,128 --repeats 3

Starts two `python -m serving.server` processes on 127.0.0.1 (prefill and
decode, one shared compilation cache) and, for each prompt length, runs
`run_disaggregated` with max_tokens=1 (so the decode worker only imports and
answers) and, as the peer measured in the same run, the same request served
whole by the decode worker (a fresh prompt each time, so no prefix-cache hits).

Recorded per length (best of `--repeats`): the KV bytes shipped and bytes per
token (2 x layers x kv_heads x head_dim x dtype bytes), `prefill_seconds`
(request sent until the payload begins: prefill, first token, device-to-host
copy), `transfer_seconds` (payload begins until its last byte was forwarded to
the decode worker) per token and as MB/s, `decode_start_seconds` (payload
begins until the decode worker answered: transfer, parse, scatter, response),
the decode worker's own read-verify-parse time (it reads the body as it streams
in and checks both HMAC tags), and `recompute_seconds` (the peer: the whole
request on one worker), with the ratio transfer / recompute per token. The
workers share a random `--kv_transfer_secret`; `sign_verify_seconds` is what
HMAC-SHA256 signing plus verifying a payload of that size costs in this
process, measured in the same run (`serving.disaggregation.kv_wire`).

Writes benchmarks/results/kv_transfer_cpu.json (or `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from serving.disaggregation import kv_wire  # noqa: E402
from serving.disaggregation.disagg import run_disaggregated  # noqa: E402
from serving.server import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODEL = "bench"


SECRET = secrets.token_hex(16)


def start_worker(port: int, args, log_path: str, cache_dir: str):
    env = dict(os.environ, JAX_PLATFORMS="cpu", RIDGELINE_KV_TRANSFER_SECRET=SECRET)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "serving.server", f"--port={port}", f"--served_model_name={MODEL}",
           "--max_num_seqs=4", f"--max_num_batched_tokens={args.budget}", "--min_token_bucket=16",
           f"--max_model_len={args.max_model_len}", f"--compilation_cache_dir={cache_dir}", "--log_level=warning"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_healthy(proc, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {url} exited early")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"worker {url} did not come up")


def sign_verify_seconds(num_bytes: int, num_layers: int = 4, repeats: int = 5) -> float:
    """Best time to sign a payload of `num_bytes` array bytes layer by layer (as /internal/prefill streams
    it) and to read and verify it from 64 KiB chunks (as the decode worker receives it)."""
    keys, layer = kv_wire.SigningKeys(SECRET), os.urandom(num_bytes // num_layers)

    async def verify(payload: bytes):
        async def chunks():
            for i in range(0, len(payload), 1 << 16):
                yield payload[i:i + (1 << 16)]

        await kv_wire.read_payload(chunks(), keys, 4096, lambda h: num_layers * len(layer))

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        signer = kv_wire.PayloadSigner(keys, {"num_tokens": num_bytes})
        pieces = [signer.head()] + [signer.body(layer) for _ in range(num_layers)] + [signer.tail()]
        t1 = time.perf_counter()
        payload = b"".join(pieces)  # the socket's job, not counted
        t2 = time.perf_counter()
        asyncio.run(verify(payload))
        best = min(best, (t1 - t0) + (time.perf_counter() - t2))
    return best


def prompt_of(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]  # byte tokens; fresh ones never hit a prefix cache


async def measure(urls, n: int, rng: random.Random) -> dict:
    prefill, decode = urls
    async with httpx.AsyncClient(timeout=600) as client:
        body = {"model": MODEL, "prompt": prompt_of(n, rng), "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        resp, rec = await run_disaggregated(client, prefill, decode, "/v1/completions", body)
        await resp.aread()
        await resp.aclose()
        total = time.perf_counter() - t0
        assert resp.status_code == 200, resp.text
        parse = float(resp.headers.get("x-ridgeline-kv-parse-seconds", "nan"))
        peer = {"model": MODEL, "prompt": prompt_of(n, rng), "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        r = await client.post(decode + "/v1/completions", json=peer)
        recompute = time.perf_counter() - t0
        assert r.status_code == 200, r.text
    return {"kv_bytes": rec.kv_bytes, "payload_bytes": rec.payload_bytes, "prefill_seconds": rec.prefill_seconds,
            "transfer_seconds": rec.transfer_seconds, "decode_start_seconds": rec.decode_start_seconds,
            "decode_parse_seconds": parse, "disaggregated_total_seconds": total, "recompute_seconds": recompute}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,256,768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens of the workers")
    ap.add_argument("--max_model_len", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(RESULTS, "kv_transfer_cpu.json"))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = tempfile.mkdtemp(prefix="kv-bench-")
    cache_dir = os.environ.get("RIDGELINE_COMPILATION_CACHE_DIR", os.path.join(tmp, "jax-cache"))
    procs, urls = [], []
    try:
        for name in ("prefill", "decode"):
            port = free_port()
            procs.append(start_worker(port, args, os.path.join(tmp, f"{name}.log"), cache_dir))
            urls.append(f"http://127.0.0.1:{port}")
            wait_healthy(procs[-1], urls[-1], 900)
        rng = random.Random(0)
        for n in lengths:  # compiles the gather/scatter and step shapes these lengths use
            asyncio.run(measure(urls, n, rng))
        rows = []
        for n in lengths:
            runs = [asyncio.run(measure(urls, n, rng)) for _ in range(args.repeats)]
            best = {k: min(r[k] for r in runs) for k in runs[0] if k.endswith("seconds")}
            kv = runs[0]["kv_bytes"]
            row = {"prompt_tokens": n, "kv_bytes": kv, "kv_bytes_per_token": kv / n,
                   "payload_bytes": runs[0]["payload_bytes"], **best,
                   "transfer_seconds_per_token": best["transfer_seconds"] / n,
                   "transfer_MB_per_s": kv / best["transfer_seconds"] / 1e6,
                   "recompute_seconds_per_token": best["recompute_seconds"] / n,
                   "transfer_over_recompute": best["transfer_seconds"] / best["recompute_seconds"],
                   "sign_verify_seconds": sign_verify_seconds(kv)}
            rows.append(row)
            print(f"{n:5d} tokens  {kv / 1e6:7.3f} MB  ({kv // n} B/token)  prefill {best['prefill_seconds']:.3f} s  "
                  f"transfer {best['transfer_seconds'] * 1e3:.2f} ms = {row['transfer_seconds_per_token'] * 1e6:.2f} "
                  f"us/token ({row['transfer_MB_per_s']:.0f} MB/s)  decode start "
                  f"{best['decode_start_seconds'] * 1e3:.1f} ms  recompute {best['recompute_seconds']:.3f} s  "
                  f"transfer/recompute {row['transfer_over_recompute']:.3f}  "
                  f"sign+verify {row['sign_verify_seconds'] * 1e3:.2f} ms", flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    record = {"benchmark": "kv_transfer", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)", "model": "embedded default",
              "transport": "HTTP over 127.0.0.1 via the router process (httpx -> uvicorn), host-staged, "
                           "HMAC-SHA256-signed payloads (RKV2)",
              "worker_flags": {"max_num_seqs": 4, "max_num_batched_tokens": args.budget,
                               "max_model_len": args.max_model_len},
              "repeats": args.repeats, "statistic": "best of repeats", "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
