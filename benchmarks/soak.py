"""Soak: a live server under a long mix of good, careless and bad requests; its RSS and open fds over time.

    python benchmarks/soak.py --duration_s 300 --concurrency 8 \\
        --result_file benchmarks/results/soak_cpu_default_model.json
    python benchmarks/soak.py --base_url http://127.0.0.1:8000 --pid 1234 ...   # a server already running

Starts `python -m serving.server` (the embedded model unless `--server_flags`
says otherwise) unless `--base_url` is given, then runs `--concurrency`
clients for `--duration_s` seconds, each drawing its next request from a
seeded mix:

  stream         a streamed completion read to its end
  disconnect     a streamed completion dropped after its first chunks
  nonstream      a plain completion
  n2             a completion with n = 2
  chat           a streamed chat completion
  structured     a chat completion constrained by a JSON schema
  bad            a request that must be a 4xx (unknown field, bad value, not JSON, a cap exceeded)

Every `--sample_s` it records the server process's resident memory (VmRSS)
and open file descriptors (from /proc), and the engine's running / waiting /
KV usage from /metrics. At the end it waits for the server to go idle and
reports: requests and outcomes per kind (any 5xx or unexpected status is a
failure), the samples, and how RSS and fds moved between the end of the first
quarter (after warm-up and the first compiles) and the end: their growth and
a least-squares slope over the last three quarters. The server must end with
nothing running, waiting or holding KV pages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = {"stream": 4, "disconnect": 2, "nonstream": 3, "n2": 2, "chat": 2, "structured": 1, "bad": 2}
WORDS = ("the quick brown fox jumps over the lazy dog while a serving engine keeps every page it owes "
         "and frees the ones it does not").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def proc_figures(pid: int) -> tuple[float, int]:
    """(resident memory in MiB, open file descriptors) of process `pid`."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def metric(text: str, name: str, **labels) -> float:
    """The sum of `name`'s samples in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        metric_name, _, rest = sample.partition("{")
        if metric_name == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


class Soak:
    def __init__(self, base_url: str, model: str, seed: int):
        self.url, self.model = base_url, model
        self.rng = random.Random(seed)
        self.outcomes: dict[str, dict[str, int]] = {k: {} for k in KINDS}
        self.failures: list[str] = []

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 40)))

    def count(self, kind: str, outcome: str, ok: bool, detail: str = "") -> None:
        self.outcomes[kind][outcome] = self.outcomes[kind].get(outcome, 0) + 1
        if not ok and len(self.failures) < 50:
            self.failures.append(f"{kind}: {outcome} {detail[:200]}")

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        max_tokens = self.rng.randint(1, 48)
        base = {"model": self.model, "prompt": self.prompt(), "max_tokens": max_tokens,
                "temperature": self.rng.choice([0.0, 0.7])}
        chat = {"model": self.model, "messages": [{"role": "user", "content": self.prompt()}],
                "max_tokens": max_tokens}
        try:
            if kind in ("stream", "disconnect", "chat"):
                path, body = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", base)
                async with client.stream("POST", path, json={**body, "stream": True}) as r:
                    if r.status_code != 200:
                        return self.count(kind, str(r.status_code), False, (await r.aread()).decode())
                    chunks, done = 0, False
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks += 1
                            done = line == "data: [DONE]"
                            if kind == "disconnect" and chunks >= 2:
                                break  # leave mid-stream: the server must abort and free the request
                    ok = done or kind == "disconnect"
                    return self.count(kind, "ok" if ok else "truncated", ok)
            if kind == "bad":
                path, body, content = self.rng.choice([
                    ("/v1/completions", {**base, "temperature": -1}, None),
                    ("/v1/chat/completions", {**chat, "audio": {"voice": "alloy"}}, None),  # not implemented
                    ("/v1/completions", {**base, "stop": ["s"] * 100}, None),
                    ("/v1/chat/completions", {**chat, "messages": []}, None),
                    ("/v1/completions", None, b"{not json"),
                    ("/v1/completions", {**base, "max_tokens": 10**9}, None),
                ])
                r = await client.post(path, json=body, content=content, headers={"content-type": "application/json"})
                ok = 400 <= r.status_code < 500 and "error" in r.json()
                return self.count(kind, str(r.status_code), ok, r.text)
            if kind == "structured":
                body = {**chat, "max_tokens": 48, "temperature": 0.0,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
                r = await client.post("/v1/chat/completions", json=body)
            else:
                r = await client.post("/v1/completions", json={**base, "n": 2} if kind == "n2" else base)
            ok = r.status_code == 200
            return self.count(kind, str(r.status_code), ok, r.text)
        except httpx.HTTPError as e:
            self.count(kind, type(e).__name__, False, str(e))

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
            while time.monotonic() < deadline:
                await self.one(client)


def _trend(samples: list[dict], key: str) -> dict:
    """Growth and slope (per hour) of `key` over the last three quarters of the run."""
    t0 = samples[-1]["t"] * 0.25
    tail = [s for s in samples if s["t"] >= t0]
    if len(tail) < 3:
        return {}
    t = np.array([s["t"] for s in tail])
    y = np.array([s[key] for s in tail], dtype=float)
    slope = float(np.polyfit(t, y, 1)[0]) * 3600
    return {"at_first_quarter": y[0], "at_end": y[-1], "max": float(y.max()), "growth": float(y[-1] - y[0]),
            "slope_per_hour": round(slope, 3)}


async def run(args, pid: int) -> dict:
    soak = Soak(args.base_url, args.model, args.seed)
    start = time.monotonic()
    deadline = start + args.duration_s
    samples: list[dict] = []

    async def sampler():
        async with httpx.AsyncClient(base_url=args.base_url, timeout=60) as client:
            while True:
                rss, fds = proc_figures(pid)
                text = (await client.get("/metrics")).text
                samples.append({"t": round(time.monotonic() - start, 1), "rss_mib": round(rss, 1), "fds": fds,
                                "running": metric(text, "vllm:num_requests_running"),
                                "waiting": metric(text, "vllm:num_requests_waiting"),
                                "kv_usage": metric(text, "vllm:kv_cache_usage_perc")})
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(args.sample_s)

    sampling = asyncio.create_task(sampler())
    await asyncio.gather(*(soak.client_loop(deadline) for _ in range(args.concurrency)))
    await sampling
    idle, waited = None, time.monotonic()
    async with httpx.AsyncClient(base_url=args.base_url, timeout=60) as client:
        while time.monotonic() - waited < 60:
            text = (await client.get("/metrics")).text
            idle = [metric(text, f"vllm:{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                         "kv_cache_usage_perc")]
            if idle == [0, 0, 0]:
                break
            await asyncio.sleep(0.2)
        text = (await client.get("/metrics")).text
    rss, fds = proc_figures(pid)
    samples.append({"t": round(time.monotonic() - start, 1), "rss_mib": round(rss, 1), "fds": fds,
                    "running": idle[0], "waiting": idle[1], "kv_usage": idle[2]})
    total = sum(sum(v.values()) for v in soak.outcomes.values())
    return {
        "duration_s": args.duration_s, "concurrency": args.concurrency, "seed": args.seed, "requests": total,
        "outcomes": soak.outcomes, "failures": soak.failures,
        "aborted_by_server": metric(text, "vllm:request_success_total", finished_reason="abort"),
        "idle_at_end": {"running": idle[0], "waiting": idle[1], "kv_cache_usage_perc": idle[2]},
        "rss_mib": _trend(samples, "rss_mib"), "open_fds": _trend(samples, "fds"), "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration_s", type=float, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample_s", type=float, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base_url", default=None, help="a running server (then --pid is needed)")
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--model", default="soak")
    ap.add_argument("--server_flags", default="--max_num_seqs=16 --max_num_batched_tokens=64 --min_token_bucket=16")
    ap.add_argument("--result_file", default=None)
    args = ap.parse_args()
    proc = None
    if args.base_url is None:
        from serving.server import free_port

        port = free_port()
        args.base_url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "serving.server", f"--port={port}", f"--served_model_name={args.model}",
               "--warmup=full", *args.server_flags.split()]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        args.pid = proc.pid
        deadline = time.monotonic() + 900
        while not _healthy(args.base_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up; see {log.name}")
            time.sleep(1)
    try:
        result = asyncio.run(run(args, args.pid))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    result.update({"server_flags": args.server_flags if proc is not None else None,
                   "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                   "server_exit_code": proc.returncode if proc is not None else None})
    ok = not result["failures"] and result["idle_at_end"] == {"running": 0, "waiting": 0, "kv_cache_usage_perc": 0}
    result["ok"] = ok
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(0 if ok else 1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
