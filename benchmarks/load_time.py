"""Loading a Hugging Face checkpoint: Ridgeline's first start (conversion) and later ones, beside transformers.

    python benchmarks/load_time.py                 # ~3 min on 2 cores
    python benchmarks/load_time.py --rounds 1

The checkpoint is the 30-layer 135M Llama shape of `benchmarks/startup.py`
(random bf16 weights written by transformers as safetensors). Each start is a
fresh Python process that times, after its imports (timed apart):

* **ridgeline first**: `serving.model_source.resolve` on the HF directory with
  an empty conversion cache (it converts the checkpoint: `model.convert_hf`),
  then `model.checkpoint.load_checkpoint` of the converted copy until every
  array is in memory: what `LLM(model=...)` and `python -m serving.server
  MODEL` do before they build the engine;
* **ridgeline cached**: the same over the cache the first start filled (the
  source's digests are checked and the converted copy is loaded);
* **transformers**: `AutoModelForCausalLM.from_pretrained` of the same
  directory in its saved dtype (bf16), the peer's load.

Both sides load the weights as saved (bf16), nothing compiled or run. The
kinds alternate for `--rounds` rounds (a first start gets a fresh cache each
round), best kept; ratios are ours / transformers'. Writes
benchmarks/results/load_time_cpu.json (or `--out`).
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

import startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RIDGELINE_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import jax
from model.checkpoint import load_checkpoint
from serving import model_source
t1 = time.perf_counter()
resolved = model_source.resolve(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
cfg, params = load_checkpoint(resolved.checkpoint)
jax.block_until_ready(params)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "resolve_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t1}))
"""

TRANSFORMERS_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
t1 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "total_s": t2 - t1}))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(runs: list[dict]) -> dict:
    """The run with the least total time, its fields rounded, and every run's total."""
    top = min(runs, key=lambda r: r["total_s"])
    return {**{k: round(v, 2) for k, v in top.items()}, "all_total_s": [round(r["total_s"], 2) for r in runs]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_time_cpu.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        hf_dir = startup.write_135m_checkpoint(d, convert=False)[0]
        size = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir))
        runs = {"ridgeline first": [], "ridgeline cached": [], "transformers": []}
        for i in range(args.rounds):
            cache = os.path.join(d, f"cache{i}", "jax")  # converted copies go beside it, in cache{i}/converted
            runs["ridgeline first"].append(run(RIDGELINE_LOAD, hf_dir, cache))
            runs["ridgeline cached"].append(run(RIDGELINE_LOAD, hf_dir, cache))
            runs["transformers"].append(run(TRANSFORMERS_LOAD, hf_dir))
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "checkpoint": "135M Llama shape, 30 layers, bf16 safetensors", "checkpoint_bytes": size,
              "rounds": args.rounds, **{k: best(v) for k, v in runs.items()}}
    peer = result["transformers"]["total_s"]
    result["vs_transformers"] = {k: round(result[k]["total_s"] / peer, 2) for k in ("ridgeline first", "ridgeline cached")}
    print(json.dumps(result, indent=1))
    startup.save(args.out, result)
    return result


if __name__ == "__main__":
    main()
