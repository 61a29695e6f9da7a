"""How long `python -m serving.server` takes to answer, cold and warm, beside transformers on the same checkpoint.

    python benchmarks/startup.py                        # embedded model + the 30-layer 135M Llama shape
    python benchmarks/startup.py --models embedded      # just the embedded model
    python benchmarks/startup.py --layer_loops scan,unroll

For each model and each `--layer_loops` setting, the server is started as a
subprocess twice with one fresh compilation-cache directory: *cold* (the cache
empty) and *warm* (the same cache, now full of what the cold run compiled).
Recorded per run, from the moment the process is started: `health_seconds`
(until `/health` first answers 200, i.e. the smallest and the largest step
bucket are compiled or loaded; the rest compile in the background) and
`first_token_seconds` (until a one-token completion of a 16-token prompt came
back, sent right after `/health`). The server's own log gives the load time.
A cold start also finds no compiled bytecode of the project (`clear_bytecode`),
as the first start after an install would. The warm start is repeated `--warm_repeats` times (single starts vary by about
20% on a shared 2-core machine); the best is recorded, with every run's times.
The cold server is left running until its background warm-up is done
(`ready_seconds`), as a server that served a while would be, so the warm start
finds every step executable it compiled.

The 135M shape (vocab 49152, hidden 576, 9 query / 3 KV heads, intermediate
1536, 30 layers, tied embeddings) gets random bf16 weights written as a Hugging
Face checkpoint by transformers and converted by `python -m model.convert_hf`
(conversion is not timed). On CPU the server computes in float32 (`--dtype
auto` there: XLA CPU's 16-bit matmuls are its slow path), as the peer does.
The peer, measured in the same run: a fresh Python process that imports
transformers, loads that checkpoint in float32 and generates one token from
the same prompt (`transformers_seconds`), best of `--repeats`.
Ratios are ours / transformers'.

On a GPU (`--platform gpu`, what `benchmarks/gpu_check.sh` runs) the model is
`llama3-8b`: the Llama-3-8B shape with random bf16 weights, written as our own
checkpoint (no conversion, no transformers peer: loading 16 GB twice would not
fit the check's time), and the cold server is not waited on for its whole
background warm-up (`--no-cold_wait_ready`), so the warm start loads the two
buckets the cold one compiled first and compiles the rest again.

Writes benchmarks/results/startup_cpu.json (or `--out`), after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_PACKAGES = ("configs", "kernels_pallas", "model", "serving", "sharding")
PROMPT = list(range(1, 17))  # 16 token ids (valid in both vocabularies)

SHAPE_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

TRANSFORMERS_FIRST_TOKEN = """
import sys, time
t0 = float(sys.argv[2])
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
ids = torch.tensor([list(range(1, 17))])
with torch.no_grad():
    model.generate(ids, max_new_tokens=1, do_sample=False)
print(time.time() - t0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_135m_checkpoint(directory: str, convert: bool = True) -> tuple[str, str | None]:
    """(HF directory, converted directory or None without `convert`) of the random 135M-shape model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir, ours = os.path.join(directory, "hf"), os.path.join(directory, "converted")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE_135M)).to(torch.bfloat16)
    model.save_pretrained(hf_dir, safe_serialization=True)
    if not convert:
        return hf_dir, None
    subprocess.run([sys.executable, "-m", "model.convert_hf", f"--hf_dir={hf_dir}", f"--out_dir={ours}"],
                   cwd=ROOT, check=True, capture_output=True)
    return hf_dir, ours


WRITE_8B = """
import sys
import jax
from model.checkpoint import save_checkpoint
from model.families import config_by_name
from model.params import init_params
cfg = config_by_name("llama3-8b")
save_checkpoint(sys.argv[1], init_params(cfg, jax.random.key(0)), cfg)
"""


def write_8b_checkpoint(directory: str) -> str:
    """Our checkpoint of the Llama-3-8B shape, random bf16 weights, made on the device and written by orbax
    in a process of its own (this one must leave the device's memory to the servers)."""
    subprocess.run([sys.executable, "-c", WRITE_8B, directory], cwd=ROOT, check=True)
    return directory


def time_server(checkpoint: str | None, cache_dir: str, layer_loop: str, extra: list[str],
                wait_ready: bool = False, platform_name: str = "cpu") -> dict:
    """One server start: seconds to /health and to the first token, from the process start; with
    `wait_ready`, also until /health reports the background warm-up done (what a server that ran a
    while leaves in the cache for its next start)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "serving.server", f"--port={port}", f"--compilation_cache_dir={cache_dir}",
           f"--layer_loop={layer_loop}", "--served_model_name=m"] + extra
    if checkpoint:
        cmd.append(f"--checkpoint={checkpoint}")
    env = dict(os.environ, JAX_PLATFORMS=platform_name)
    if platform_name == "cpu":
        env.pop("XLA_FLAGS", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # see clear_bytecode
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        health = None
        while health is None:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(log.name).read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    health = time.monotonic() - t0
            except httpx.HTTPError:
                time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1,
                                                      "temperature": 0}, timeout=600)
        r.raise_for_status()
        first = time.monotonic() - t0
        warming = httpx.get(url + "/health", timeout=10).json().get("status")
        ready = None
        while wait_ready and ready is None:
            if httpx.get(url + "/health", timeout=10).json().get("status") == "ready":
                ready = time.monotonic() - t0
            else:
                time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = open(log.name).read()
    os.unlink(log.name)
    loaded = [line for line in text.splitlines() if "loaded in" in line]
    return {"health_seconds": round(health, 2), "first_token_seconds": round(first, 2),
            "status_at_first_token": warming, "ready_seconds": None if ready is None else round(ready, 2), "load_line": loaded[-1].split("] ")[-1] if loaded else None}


def clear_bytecode() -> None:
    """Removes the project's compiled bytecode (`__pycache__`), so a cold start compiles its Python
    source as the first start after an install does. The servers run without PYTHONDONTWRITEBYTECODE
    (set on some machines): they write bytecode, as Python does by default, and a warm start reads it
    (the project's source is about 0.9 s of compiling on 2 cores; installed packages have theirs)."""
    import shutil

    for top in PROJECT_PACKAGES:
        for dirpath, dirnames, _ in os.walk(os.path.join(ROOT, top)):
            if "__pycache__" in dirnames:
                shutil.rmtree(os.path.join(dirpath, "__pycache__"))


def versions() -> dict:
    """The versions startup depends on most: import time is about a second of a warm start, and one
    release of ml_dtypes alone added a second to it."""
    import importlib.metadata

    out = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "numpy", "ml_dtypes"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def time_transformers(hf_dir: str, repeats: int) -> float:
    best = None
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", TRANSFORMERS_FIRST_TOKEN, hf_dir, repr(time.time())],
                             capture_output=True, text=True, check=True)
        seconds = float(out.stdout.strip().splitlines()[-1])
        best = seconds if best is None else min(best, seconds)
    return round(best, 2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="embedded,llama-135m-30l")
    p.add_argument("--layer_loops", default="auto", help="comma-separated --layer_loop values to start with")
    p.add_argument("--repeats", type=int, default=2, help="transformers runs (best kept)")
    p.add_argument("--platform", default="cpu", choices=("cpu", "gpu"),
                   help="where the servers run (gpu: the llama3-8b model only)")
    p.add_argument("--cold_wait_ready", action=argparse.BooleanOptionalAction, default=True,
                   help="let the cold server finish its background warm-up before the warm start")
    p.add_argument("--warm_repeats", type=int, default=3, help="warm starts over the cold one's cache (best kept)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup_cpu.json"))
    args = p.parse_args(argv)
    if args.platform == "gpu" and args.models != "llama3-8b":
        p.error("--platform gpu measures --models llama3-8b")
    work = tempfile.mkdtemp(prefix="ridgeline-startup-")
    results = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "versions": versions(), "prompt_tokens": len(PROMPT), "runs": []}
    for model in args.models.split(","):
        checkpoint, peer = None, None
        if model == "llama-135m-30l":
            hf_dir, checkpoint = write_135m_checkpoint(os.path.join(work, model))
            peer = time_transformers(hf_dir, args.repeats)
        elif model == "llama3-8b":
            checkpoint = write_8b_checkpoint(os.path.join(work, model))
        for loop in args.layer_loops.split(","):
            cache_dir = tempfile.mkdtemp(prefix="cache-", dir=work)
            row = {"model": model, "layer_loop": loop, "transformers_seconds": peer}
            clear_bytecode()
            row["cold"] = time_server(checkpoint, cache_dir, loop, [], platform_name=args.platform,
                                      wait_ready=args.cold_wait_ready)
            # Warm starts vary by ~20% on a shared machine: the best of --warm_repeats is kept, all are listed.
            warm = [time_server(checkpoint, cache_dir, loop, [], platform_name=args.platform)
                    for _ in range(args.warm_repeats)]
            row["warm"] = dict(min(warm, key=lambda r: r["first_token_seconds"]),
                               all_first_token_seconds=[r["first_token_seconds"] for r in warm],
                               all_health_seconds=[r["health_seconds"] for r in warm])
            for phase in ("cold", "warm"):
                if peer:
                    row[phase]["first_token_vs_transformers"] = round(row[phase]["first_token_seconds"] / peer, 2)
            results["runs"].append(row)
            save(args.out, results)
            print(f"{model:16s} layer_loop={loop:6s} cold: health {row['cold']['health_seconds']:6.1f} s, first "
                  f"token {row['cold']['first_token_seconds']:6.1f} s | warm: health "
                  f"{row['warm']['health_seconds']:6.1f} s, first token {row['warm']['first_token_seconds']:6.1f} s"
                  + (f" (cold warm-up all done at {row['cold']['ready_seconds']:.0f} s)"
                     if row["cold"]["ready_seconds"] else "")
                  + (f" | transformers {peer:.1f} s (cold {row['cold']['first_token_vs_transformers']}x, warm "
                     f"{row['warm']['first_token_vs_transformers']}x)" if peer else ""), flush=True)
    return results


def save(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
