"""The program tests/test_multihost.py runs in every process of a multi-process run.

    python -m serving.launch --num_processes=2 --devices_per_process=2 -- \\
        python tests/multihost_worker.py --out DIR [--layouts tp4 pp2tp2] [--die_process 1 --die_after_steps 3]

For each layout (`tp4`: tensor parallelism over the 4 devices of both
processes; `pp2tp2`: two pipeline stages, one per process, each 2-way tensor
parallel, 2 microbatches) each process builds the same `LLM` (a small random
model, seeded, so every process and the test's own single-process reference
hold the same weights), runs `generate` on a mixed batch and writes the token
ids it got back to DIR/p<process>.json. `--die_process P --die_after_steps K` makes process P
kill itself (SIGKILL) when it reaches its K-th step, to test failure detection.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.params import init_params  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402
from serving.cluster import distributed

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=8, num_kv_heads=4,
                  head_dim=8, rope_theta=10000.0, dtype="float32", max_position_embeddings=1024,
                  bos_token_id=1, eos_token_ids=(2,))
ENGINE = dict(page_size=8, max_model_len=128, num_pages=64, max_num_seqs=8, max_num_batched_tokens=32,
              min_token_bucket=32, min_context_bucket=128, attention_backend="reference")


def params():
    return init_params(CFG, jax.random.key(11))


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Ragged prompts, some longer than the token budget (so their prefill is chunked)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, CFG.vocab_size) for _ in range(rng.randint(2, 45))] for _ in range(n)]


def sampling(max_tokens: int = 8) -> list[SamplingParams]:
    """Greedy, with varied lengths; one request forks two samples (its pages are copied on write)."""
    out = []
    for i in range(len(prompts())):
        out.append(SamplingParams(temperature=0.0, max_tokens=max_tokens + 3 * i, ignore_eos=True, n=2 if i == 2 else 1))
    return out


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def die_at_step(llm, after: int) -> None:
    """Kills this process (SIGKILL, no clean-up) when it starts its `after`-th step."""
    runner = llm.engine.runner
    run = runner._run
    count = [0]

    def counting_run(*args, **kwargs):
        count[0] += 1
        if count[0] >= after:
            print(f"process {jax.process_index()} kills itself at step {count[0]} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return run(*args, **kwargs)

    runner._run = counting_run


LAYOUTS = {"tp4": dict(tensor_parallel_size=4), "pp2tp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                                 num_microbatches=2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", default=["tp4"], choices=sorted(LAYOUTS))
    ap.add_argument("--max_tokens", type=int, default=8)
    ap.add_argument("--die_process", type=int, default=None)
    ap.add_argument("--die_after_steps", type=int, default=3)
    args = ap.parse_args()
    distributed.initialize()  # before anything touches a device (the params below do)
    me = jax.process_index()
    result = {"process": me}
    for name in args.layouts:
        llm = LLM(config=CFG, params=params(), **LAYOUTS[name], **ENGINE)
        print(f"process {me} of {jax.process_count()}: {name} over {jax.local_device_count()} local devices, "
              f"{jax.device_count()} in all", flush=True)
        if args.die_process == me:
            die_at_step(llm, args.die_after_steps)
        outputs = llm.generate(prompts(), sampling(args.max_tokens))
        replayed = getattr(llm.multihost, "calls_by_kind", None)  # a follower's count of replayed calls
        result[name] = {"tokens": token_ids(outputs), "replayed": replayed}
    with open(os.path.join(args.out, f"p{me}.json"), "w") as f:
        json.dump(result, f)
    print(f"process {me} done", flush=True)


if __name__ == "__main__":
    main()
