"""What finer decode buckets cost at warm-up: the embedded model's step programs with `decode_bucket_step` 8 against 0.

    python benchmarks/decode_buckets_warmup.py [--step 8] [--out benchmarks/results/decode_buckets_warmup.json]

One process builds `LLM()` (the embedded model, the server's default limits, compilation cache off) with
`decode_bucket_step=--step` and compiles every step bucket of its full warm-up one at a time, timing
each (wall and process CPU seconds): first the buckets the step adds, then the powers-of-two set. The
programs of the buckets both sets share are the same, so the powers-of-two warm-up is the sum over its
own buckets and the finer set's adds the added buckets' compiles. (The server's warm-up overlaps each
compile with the next bucket's tracing, so its wall time is somewhat less than these sums.) The JSON is
rewritten after every bucket, so a run stopped early keeps what it measured; the machine is shared, and
the load average is recorded with every bucket.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from serving import LLM  # noqa: E402
from serving.core.input_batch import Buckets, StepShape  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=8, help="the decode_bucket_step measured against 0")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "decode_buckets_warmup.json"))
    args = ap.parse_args()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "command": "python benchmarks/decode_buckets_warmup.py " + " ".join(sys.argv[1:]),
              "loadavg_before": os.getloadavg(), "buckets": []}
    llm = LLM(warmup=False, compilation_cache_dir="", decode_bucket_step=args.step)
    b = llm.engine.buckets
    pow2 = Buckets(b.max_num_batched_tokens, b.max_num_seqs, b.max_pages_per_seq, b.min_tokens, b.min_pages,
                   decode_step=0)
    shared = set(pow2.all_shapes())
    added = [s for s in b.all_shapes() if s not in shared]
    result.update(token_sizes=b.token_sizes, powers_of_two_token_sizes=pow2.token_sizes,
                  step_programs=len(b.all_shapes()), powers_of_two_step_programs=len(shared),
                  added=[list(s) for s in added])
    programs = llm.engine.runner.programs
    for T, S, P in added + [s for s in b.all_shapes() if s in shared]:
        shape = b.step_shape(T, S, P)
        t, c = time.perf_counter(), time.process_time()
        programs.warm_up([shape], background=False)
        row = {"T": T, "S": S, "P": P, "added": (T, S, P) in added, "seconds": time.perf_counter() - t,
               "cpu_seconds": time.process_time() - c, "loadavg": os.getloadavg()}
        result["buckets"].append(row)
        print(json.dumps(row), flush=True)
        done = result["buckets"]
        result["totals"] = {
            "added_seconds": sum(r["seconds"] for r in done if r["added"]),
            "added_cpu_seconds": sum(r["cpu_seconds"] for r in done if r["added"]),
            "powers_of_two_seconds": sum(r["seconds"] for r in done if not r["added"]),
            "powers_of_two_cpu_seconds": sum(r["cpu_seconds"] for r in done if not r["added"]),
            "powers_of_two_buckets_measured": sum(not r["added"] for r in done)}
        result["loadavg_after"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result["totals"]), "wrote", args.out)


if __name__ == "__main__":
    main()
