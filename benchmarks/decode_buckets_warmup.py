"""What finer decode buckets cost at warm-up: the embedded model's full warm-up, `decode_bucket_step` 0 against 8.

    python benchmarks/decode_buckets_warmup.py [--steps 0,8] [--rounds 1]

Each measurement is a fresh process (`LLM()` with the server's default limits, `warmup=True`: every step
bucket compiles, as the server's background warm-up does after its first two), with the compilation
cache off, so nothing is shared between them. The settings alternate within each round (the order
flips every round). Recorded per run: the programs compiled, the warm-up's wall and CPU seconds. The
machine is shared: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, time
from serving import LLM
c = time.process_time()
llm = LLM(warmup=True, compilation_cache_dir="", decode_bucket_step={step})
info = llm.warmup_info
print(json.dumps({{"decode_bucket_step": {step}, "token_sizes": llm.engine.buckets.token_sizes,
                  "step_shapes": len(llm.engine.buckets.all_shapes()), "programs_compiled": info["compiled"],
                  "warmup_seconds": info["seconds"], "process_cpu_seconds": time.process_time() - c}}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="0,8", help="comma-separated decode_bucket_step values")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "decode_buckets_warmup.json"))
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "command": "python benchmarks/decode_buckets_warmup.py " + " ".join(sys.argv[1:]),
              "loadavg_before": os.getloadavg(), "runs": []}
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for r in range(args.rounds):
        for step in (steps if r % 2 == 0 else steps[::-1]):
            load = os.getloadavg()
            out = subprocess.run([sys.executable, "-c", CHILD.format(step=step)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True)
            run = dict(json.loads(out.stdout.strip().splitlines()[-1]), round=r, loadavg_before=load)
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
    result["loadavg_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
