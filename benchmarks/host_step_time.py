"""The engine's host time per step, with a device that answers at once.

On a GPU an 8B decode step at batch 64 takes a few milliseconds; the host's
scheduling, packing and output processing must fit inside it, or overlapped
scheduling cannot hide it. This benchmark runs the real `Engine.step` (the
scheduler, block manager, packing, the step parts, detokenization and stop
checks) over a runner that does no device work: its `dispatch` returns the
step's tokens at once, so all that is timed is the host. Each case keeps N
sequences decoding (one token per sequence per step, as a steady decode batch
does) and reports the host time of a step (`IterationStats.host_seconds`, the
step's wall time without the wait for its results) as the median and 90th
percentile over the measured steps.

Cases: plain greedy decoding; every request under a JSON grammar (structured
outputs: a mask per row per step, computed by llguidance); every request with
sampling controls (penalties, logit bias: a control slot each); n-gram
speculation with 3 drafts per sequence (the fake device accepts every draft).
LoRA needs adapter slots on the device and is not part of this host-only run.

    python benchmarks/host_step_time.py [--seqs 1,64,256,1024] [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.tokenizer import ByteTokenizer  # noqa: E402
from serving.core.engine import Engine, EngineConfig  # noqa: E402
from serving.core.model_runner import PendingStep  # noqa: E402
from serving.core.sampling_params import SamplingParams  # noqa: E402
from serving.features.sampling_controls import SamplingControlsPart  # noqa: E402
from serving.features.structured_output import StructuredOutputsPart  # noqa: E402

VOCAB = 320  # the byte tokenizer's (grammars need real text tokens)
PROMPT_LEN = 16
PAGE_SIZE = 16


class InstantRunner:
    """A runner whose steps cost the host nothing beyond building their result: each sampling row gets a
    byte that keeps every grammar open (a space inside a JSON string is always allowed), verifying rows
    accept their drafts."""

    def __init__(self, cfg, max_num_seqs: int, logit_parts=(), sampler_part=None):
        self.cfg = cfg
        self.logit_parts = tuple(logit_parts)  # their host inputs are built every step, as a real runner's
        self.sampler_part = sampler_part

    def copy_pages(self, copies):
        pass

    def step_shape(self, shape):
        return shape

    def warmup_stats(self):
        return None

    def update_part_state(self, part, jitted, *host_args):
        pass

    def dispatch(self, batch) -> PendingStep:
        ids = np.full(batch.shape.S, ord("a"), np.int32)
        for first, _, _, drafts in batch.proposal_groups:
            ids[first:first + len(drafts)] = drafts
        return PendingStep(ids)


def engine_for(case: str, num_seqs: int) -> Engine:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=1024,
                      bos_token_id=256, eos_token_ids=(257,))
    spec = case == "ngram"
    max_tokens = 400  # more than the measured steps draw (4 a step with speculation)
    max_model_len = PROMPT_LEN + max_tokens
    pages_per_seq = -(-max_model_len // PAGE_SIZE)
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(num_seqs * (4 if spec else 1), 64),
                          page_size=PAGE_SIZE, num_pages=num_seqs * pages_per_seq + 8, max_model_len=max_model_len,
                          async_scheduling=False, speculative_method="ngram" if spec else None,
                          num_speculative_tokens=3 if spec else 0)
    # what serving.features.build_parts gives a server
    parts = [SamplingControlsPart(num_seqs, cfg.vocab_size), StructuredOutputsPart(cfg.vocab_size)]
    runner = InstantRunner(cfg, num_seqs, logit_parts=parts)
    if spec:
        from serving.spec_decode import SpecDecoder
        from serving.spec_decode.verifier import SpecVerifier

        runner.sampler_part = SpecVerifier("ngram", 3, num_seqs, cfg.vocab_size)
        parts += [runner.sampler_part, SpecDecoder.for_engine]
    engine = Engine(cfg, None, ByteTokenizer(VOCAB), config, runner=runner, parts=parts)
    for i in range(num_seqs):
        kw = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if case == "grammar":
            kw["structured_outputs"] = {"regex": "[a-z ]{1,20000}"}
        elif case == "controls":
            kw.update(presence_penalty=0.5, repetition_penalty=1.1, logit_bias={ord("b"): 1.0})
        # n-gram speculation: a repeating prompt, so the proposer finds its next tokens in it
        text = [ord("a")] * (PROMPT_LEN - 1) if spec else [97 + (i + j) % 26 for j in range(PROMPT_LEN - 1)]
        prompt = [256] + text
        engine.add_request(f"r{i}", prompt, SamplingParams(**kw))
    return engine


def measure(case: str, num_seqs: int, steps: int) -> dict:
    engine = engine_for(case, num_seqs)
    seen = []
    engine.stats_log.add_listener(seen.append)
    t0 = time.perf_counter()
    while not seen or seen[-1].num_seqs < num_seqs:  # prefill until every sequence decodes
        engine.step()
        if time.perf_counter() - t0 > 300:
            raise RuntimeError(f"{case} x{num_seqs}: the batch never filled")
    first = len(seen)
    for _ in range(steps):
        engine.step()
    host = [it.host_seconds for it in seen[first:]]
    tokens = sum(it.num_generation_tokens for it in seen[first:])
    return {"case": case, "running": num_seqs, "steps": len(host),
            "host_ms_median": round(1e3 * statistics.median(host), 3),
            "host_ms_p90": round(1e3 * sorted(host)[int(0.9 * (len(host) - 1))], 3),
            "host_us_per_token": round(1e6 * sum(host) / max(tokens, 1), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1,64,256,1024", help="running sequences of each case")
    ap.add_argument("--cases", default="plain,grammar,controls,ngram")
    ap.add_argument("--steps", type=int, default=40, help="decode steps measured per case (at most 90)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        for n in (int(x) for x in args.seqs.split(",")):
            row = measure(case, n, args.steps)
            rows.append(row)
            print(f"{case:9s} x{n:5d}: host {row['host_ms_median']:8.3f} ms/step (p90 {row['host_ms_p90']:8.3f}), "
                  f"{row['host_us_per_token']:7.2f} us/token", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
                       "cpus": os.cpu_count(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
