"""Where a speculative step's time goes, and so what overlapping it with the next step could hide.

    python benchmarks/spec_overlap.py [--out benchmarks/results/spec_overlap_cpu.json] [--requests 8]

Overlapped scheduling (`async_scheduling`) dispatches step t+1 before step t's tokens reach the
host. A speculating engine steps one at a time instead: step t+1's drafts (the proposer reads the
tokens step t accepted), its query positions and its KV slots (one per accepted token) all follow
from step t's verification. What could still overlap is the host work that does not feed step t+1:
taking step t's tokens in (detokenizing, stop checks, outputs). This script measures, per step of a
speculating engine on the embedded model pair, the time spent waiting for the device, proposing
(the draft model or prompt lookup), scheduling and packing, and processing the outputs, next to the
plain engine with the overlap on and off, in one process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving import LLM, SamplingParams  # noqa: E402
from serving.spec_decode import SpecDecoder

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=16, min_token_bucket=16, min_context_bucket=256,
              max_model_len=256, enable_prefix_caching=False)
PROMPTS = ["def __init__(self, name, value):\n", "import os\nimport sys\n\n\ndef main():\n",
           "class Reader:\n    def read(self, n=-1):\n", "    for key, value in items:\n"]


class Timer:
    """Wall time spent inside wrapped methods, by name."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)


def measure(llm: LLM, requests: int, new_tokens: int) -> dict:
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    llm.generate(batch, sp)  # compiles what the workload uses
    timer = Timer()
    if eng.part(SpecDecoder) is not None:
        timer.wrap(eng.part(SpecDecoder), "propose", "propose")
    timer.wrap(eng, "_schedule", "schedule")
    timer.wrap(eng, "_pack", "pack")
    timer.wrap(eng, "_outputs", "outputs")
    eng.stats_log.drain()
    t0 = time.perf_counter()
    llm.generate(batch, sp)
    wall = time.perf_counter() - t0
    steps = eng.stats_log.drain()
    device = sum(s.device_seconds for s in steps)
    host = sum(s.host_seconds for s in steps)
    # `_process` takes the tokens in; the wait for the device inside it is `device`.
    row = {"steps": len(steps), "wall_seconds": round(wall, 3), "device_wait_seconds": round(device, 3),
           "host_seconds": round(host, 3), "tokens": requests * new_tokens,
           "tokens_per_second": round(requests * new_tokens / wall, 1)}
    for label, sec in timer.seconds.items():
        row[f"{label}_seconds"] = round(sec, 3)
    # The rest of the host's time: dispatching, and taking the tokens in (stop checks, detokenizing): what an
    # overlap of a speculating engine could hide.
    row["dispatch_and_take_in_seconds"] = round(host - sum(timer.seconds.values()), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/spec_overlap_cpu.json")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=48)
    args = ap.parse_args()
    configs = {"plain, overlapped": dict(async_scheduling=True), "plain, one at a time": dict(async_scheduling=False),
               "ngram k=3": dict(speculative_method="ngram", num_speculative_tokens=3),
               "draft k=3": dict(speculative_method="draft", num_speculative_tokens=3)}
    rows = {}
    for name, options in configs.items():
        rows[name] = measure(LLM(**ENGINE, **options), args.requests, args.new_tokens)
        print(name, rows[name], flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_avg_before": os.getloadavg(), "engine": ENGINE, "requests": args.requests,
              "new_tokens": args.new_tokens, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
