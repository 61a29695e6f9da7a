"""Engine counters and per-step observations, shaped for Prometheus export.

Two kinds of numbers:

* `EngineStats`: a snapshot of gauges and cumulative counters (running and
  waiting requests, KV pages used/total, preemptions, prefix-cache queried and
  hit tokens, prompt and generation tokens, finished requests by reason).
  Read it with `Engine.stats()` at scrape time.
* `IterationStats`: what one step observed (tokens in the step, time to first
  token of requests that got their first token, inter-token latencies,
  requests that finished with their queue time and end-to-end latency, host
  and device time). Delivered to listeners (`StatsLog.add_listener(fn)`,
  called on the engine thread right after the step; keep them quick) and kept
  in a bounded queue for `StatsLog.drain()`.

All times are seconds from `time.monotonic()`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Optional


@dataclasses.dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    e2e_latency: float
    queue_time: Optional[float]
    prompt_tokens: int
    generation_tokens: int
    # The phases of vLLM's request metrics (None where the request never reached the phase):
    # first scheduled -> first token (prefill), first -> last token (decode), first scheduled -> last token.
    prefill_time: Optional[float] = None
    decode_time: Optional[float] = None
    inference_time: Optional[float] = None
    n: Optional[int] = None  # the request's parameters
    max_tokens: Optional[int] = None


@dataclasses.dataclass
class IterationStats:
    step: int
    num_tokens: int  # tokens the step computed (prefill chunks + decodes)
    num_seqs: int
    num_prompt_tokens: int  # of those, prompt tokens (recomputation included)
    num_generation_tokens: int  # tokens sampled and kept
    kv_tokens_read: int  # K/V positions attended over (for bandwidth accounting)
    host_seconds: float  # scheduling, packing, output processing
    device_seconds: float  # from launching the step until the sampled ids arrived
    num_preemptions: int
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)
    # The shape of the step dispatched in this iteration, for accounting what padding costs
    # (benchmarks/offline_throughput.py's breakdown): its bucket (T tokens, S rows, P pages per
    # sequence) and, per scheduled sequence in row order, its new tokens and its context length
    # after the step. With overlapped scheduling `device_seconds` is the wait for the step
    # dispatched one iteration earlier, so attribute times to shapes one step at a time.
    bucket: Optional[tuple[int, int, int]] = None
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()


@dataclasses.dataclass
class EngineStats:
    num_running: int  # requests with a sequence scheduled or mid-flight
    num_waiting: int  # requests queued and not yet admitted
    kv_pages_used: int
    kv_pages_total: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    generation_tokens: int
    finished_by_reason: dict
    num_steps: int
    spec_decode: Optional[object] = None  # spec_decode.SpecStats when speculation is on
    page_size: int = 0  # tokens per KV page (what a router needs to name this engine's cached blocks)
    warmup: Optional[object] = None  # step_programs.WarmupStats: compiled buckets, larger-bucket steps
    host_kv: Optional[object] = None  # `serving.features.host_kv_tier.HostTierStats` when the host KV tier is on (its part fills it)
    lora: Optional[dict] = None  # LoRA adapters in use and requests per adapter (`LoraManager.info`), when served

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


class StatsLog:
    """Cumulative counters plus the delivery of `IterationStats` to consumers."""

    def __init__(self, maxlen: int = 10_000):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_by_reason: collections.Counter = collections.Counter()
        self.num_steps = 0
        self._listeners: list[Callable[[IterationStats], None]] = []
        self._queue: collections.deque[IterationStats] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add_listener(self, fn: Callable[[IterationStats], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn) -> None:
        with self._lock:
            self._listeners.remove(fn)

    def count_finished(self, reason: str) -> None:
        self.finished_by_reason[reason] += 1

    def record(self, it: IterationStats) -> None:
        """Counts a step and hands its observations to listeners and the queue."""
        self.num_steps += 1
        self.generation_tokens += it.num_generation_tokens
        with self._lock:
            self._queue.append(it)
            listeners = list(self._listeners)
        for fn in listeners:
            fn(it)

    def drain(self) -> list[IterationStats]:
        """Everything recorded since the last drain (oldest first; bounded)."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out
