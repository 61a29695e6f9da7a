"""Prometheus metrics for the server, named as vLLM names them with `ridgeline:` in place of `vllm:`.

Dashboards and alerts written for vLLM can be re-pointed by replacing the
prefix. Every series carries a `model_name` label, as vLLM's do.

Besides vLLM's set, two gauges no other engine exports:

  ridgeline:model_bandwidth_utilization   MBU over the last window: bytes the
      forward passes had to read (the weights once per step, plus every live
      sequence's KV cache) per second of wall-clock time, over the device's
      peak memory bandwidth.
  ridgeline:model_flops_utilization       MFU over the last window: model
      FLOPs (2 per matmul weight per token computed, prefill and decode
      alike; attention's own FLOPs are left out, as the usual definition
      does) per second, over the device's peak dense bf16 FLOP/s.

Both are per device: the figures are divided by the number of devices the
model runs on. The peaks come from `device_peak`, which looks the device up
in the planner's GPU table (`sharding.hardware`) and takes flag overrides; on a device it does not know (a CPU)
the two gauges are absent rather than wrong. Judge decode by MBU, prefill by MFU.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Optional

from kernels_pallas.pow2 import powers_of_two

# --- device peaks ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    name: str
    bandwidth: float  # bytes/s of device memory (HBM), spec sheet
    flops: float  # dense bf16 FLOP/s, spec sheet (never the 2:4-sparsity figure)


# `jax.Device.device_kind` (lower-cased, e.g. "nvidia h100 80gb hbm3") -> key of sharding.hardware.GPUS,
# matched in order so the specific names win; None marks a known device the table does not hold
# (so an L40S is never taken for an L4).
_DEVICE_KIND_KEYS: tuple[tuple[str, str | None], ...] = (
    ("gh200", None),
    ("h200", "h200"),
    ("h100 pcie", "h100-pcie"),
    ("h100 nvl", None),
    ("h100", "h100-sxm"),
    ("a100-sxm4-40gb", None),
    ("a100-pcie-40gb", None),
    ("a100", "a100-80gb"),
    ("l40", None),
    ("l4", "l4"),
)


def device_peak(device_kind: str | None = None, bandwidth: float | None = None,
                flops: float | None = None) -> Optional[DevicePeak]:
    """Peak figures for `device_kind` (default: the first jax device) from the GPU table
    `sharding.hardware.GPUS`, with either figure overridden by the caller (server flags).

    Returns None when the device is not in the table and the overrides do not give both.
    """
    from sharding.hardware import GPUS

    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    kind = device_kind.lower()
    key = next((k for pattern, k in _DEVICE_KIND_KEYS if pattern in kind), None)
    gpu = GPUS.get(key) if key else None
    if gpu is None and (bandwidth is None or flops is None):
        return None
    return DevicePeak(name=gpu.name if gpu else device_kind,
                      bandwidth=bandwidth if bandwidth is not None else gpu.hbm_bandwidth,
                      flops=flops if flops is not None else gpu.bf16_flops)


# --- what a step costs -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What the model reads and computes, from its config and weight bytes.

    `weight_bytes` counts the weights a forward pass streams: everything but
    an untied input embedding table, of which a step only gathers a few rows.
    A mixture of experts' expert weights are `expert_weight_bytes` apart: a step
    reads the expected fraction its tokens touch (`sharding.moe_plan`), and
    `flops_per_token` counts the active parameters only.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float  # 2 per matmul weight (a mixture of experts: per active weight)
    num_devices: int = 1
    expert_weight_bytes: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def from_config(cls, cfg, weight_bytes: float | None = None, kv_bytes_per_element: int | None = None,
                    num_devices: int = 1, streamed_weight_bytes: float | None = None,
                    kv_bytes_per_token: float | None = None) -> "ModelCost":
        """`streamed_weight_bytes` / `kv_bytes_per_token`, when given, are the real counts
        (quantized weights and their scales, a quantized KV cache's scales); otherwise they are
        estimated from `weight_bytes` or the config, assuming one dtype throughout."""
        import numpy as np

        from model.families import active_params, expert_params, kv_bytes_per_token as kv_bytes, num_params

        params, experts = num_params(cfg), expert_params(cfg)
        if weight_bytes is None:
            weight_bytes = params * np.dtype(cfg.jnp_dtype).itemsize
        embed = cfg.vocab_size * cfg.hidden_size
        untied_embed = 0 if cfg.tie_word_embeddings else embed
        if streamed_weight_bytes is None:
            streamed_weight_bytes = float(weight_bytes) * (params - untied_embed) / params
        if kv_bytes_per_token is None:
            kv_bytes_per_token = kv_bytes(cfg, bytes_per_element=kv_bytes_per_element)
        expert_bytes = float(streamed_weight_bytes) * experts / (params - untied_embed)  # same dtype assumed
        return cls(
            weight_bytes=float(streamed_weight_bytes) - expert_bytes,
            kv_bytes_per_token=float(kv_bytes_per_token),
            flops_per_token=2.0 * (active_params(cfg) - untied_embed - cfg.hidden_size * (2 * cfg.num_layers + 1)),
            num_devices=num_devices,
            expert_weight_bytes=expert_bytes,
            num_experts=getattr(cfg, "num_experts", 0),
            experts_per_token=getattr(cfg, "num_experts_per_tok", 0),
        )

    def bytes_read(self, steps: float, kv_tokens_read: float, tokens: float | None = None) -> float:
        """Bytes `steps` steps read; the experts' share at the expected fraction that
        `tokens / steps` tokens per step touch (all of them when `tokens` is not given)."""
        experts = self.expert_weight_bytes
        if experts and tokens is not None and steps > 0:
            from sharding.moe_plan import touched_fraction

            experts *= touched_fraction(self.num_experts, self.experts_per_token, tokens / steps)
        return steps * (self.weight_bytes + experts) + kv_tokens_read * self.kv_bytes_per_token

    def flops(self, tokens: float) -> float:
        return tokens * self.flops_per_token


class UtilizationWindow:
    """MBU and MFU over a sliding wall-clock window of cumulative work counters.

    `add(now, steps, tokens, kv_tokens_read)` records cumulative totals after
    a step; `utilization(now)` divides the work done between the oldest sample
    inside the window and `now` by the elapsed time. Idle time counts: the
    gauges say how much of the device the server used, and fall to 0 when idle.
    """

    def __init__(self, cost: ModelCost, peak: Optional[DevicePeak], window_s: float = 10.0,
                 start: float | None = None):
        self.cost, self.peak, self.window_s = cost, peak, window_s
        self._samples: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._start = time.monotonic() if start is None else start  # nothing happened before this

    def add(self, now: float, steps: float, tokens: float, kv_tokens_read: float) -> None:
        with self._lock:
            self._samples.append((now, steps, tokens, kv_tokens_read))
            while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()

    def utilization(self, now: float | None = None) -> tuple[float, float] | None:
        """(MBU, MFU) as fractions over the window ending at `now`; None without peak figures."""
        if self.peak is None:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            samples = [s for s in self._samples if s[0] > now - self.window_s]
            base = next((s for s in reversed(self._samples) if s[0] <= now - self.window_s), None)
        if not samples:
            return 0.0, 0.0
        t0 = max(now - self.window_s, self._start)
        _, s0, n0, kv0 = base if base is not None else (t0, 0, 0, 0)
        _, s1, n1, kv1 = samples[-1]
        dt = max(now - t0, 1e-9)
        per_dev = max(1, self.cost.num_devices)
        mbu = self.cost.bytes_read(s1 - s0, kv1 - kv0, n1 - n0) / per_dev / dt / self.peak.bandwidth
        mfu = self.cost.flops(n1 - n0) / per_dev / dt / self.peak.flops
        return mbu, mfu


# --- the Prometheus side ---------------------------------------------------------------------

PREFIX = "ridgeline:"

# Log-spaced latency buckets (seconds): fine where interactive serving lives, coarse in the tail.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 25.0,
                 50.0, 100.0, 250.0, 1000.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                25.0, 100.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1200.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def _token_buckets(max_tokens: int) -> tuple[float, ...]:
    return tuple(float(b) for b in powers_of_two(max_tokens))


class ServerMetrics:
    """The /metrics registry of one server over one `AsyncEngine`.

    Gauges and counters are read from `engine.stats()` when Prometheus
    scrapes, so they can never drift from the engine's own bookkeeping.
    Latency histograms are fed by a stats listener on the engine thread
    (`attach`), which only does a few bisects per step.
    """

    def __init__(self, engine, model_name: str, cost: ModelCost | None = None, peak: DevicePeak | None = None,
                 window_s: float = 10.0, max_num_batched_tokens: int = 8192):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Histogram

        # No `*_created` series: vLLM's endpoint has none, and they double the size of every scrape.
        prometheus_client.disable_created_metrics()
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.window = UtilizationWindow(cost, peak, window_s) if cost is not None else None
        self._cum = [0, 0, 0]  # steps, tokens, kv tokens read (cumulative, engine thread only)
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        max_tokens = max_num_batched_tokens
        self.ttft = hist("time_to_first_token_seconds", "Time to first token, from arrival.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency, arrival to finish.",
                        _REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited before it was first scheduled.",
                          _QUEUE_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.",
                                     _token_buckets(max_tokens))
        self.prompt_tokens_hist = hist("request_prompt_tokens", "Prompt tokens per finished request.",
                                       _token_buckets(1 << 17))
        self.generation_tokens_hist = hist("request_generation_tokens", "Generated tokens per finished request.",
                                           _token_buckets(1 << 17))
        self.registry.register(_SnapshotCollector(self))

    # Called on the engine thread after every step.
    def on_iteration(self, it) -> None:
        self.iteration_tokens.observe(it.num_tokens)
        for x in it.time_to_first_tokens:
            self.ttft.observe(x)
        for x in it.inter_token_latencies:
            self.itl.observe(x)
        for f in it.finished:
            self.e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue.observe(f.queue_time)
            self.prompt_tokens_hist.observe(f.prompt_tokens)
            self.generation_tokens_hist.observe(f.generation_tokens)
        if self.window is not None and it.num_tokens:
            c = self._cum
            c[0] += 1
            c[1] += it.num_tokens
            c[2] += it.kv_tokens_read
            self.window.add(time.monotonic(), *c)

    def attach(self) -> "ServerMetrics":
        """Starts feeding the histograms from the engine's per-step stats."""
        self.engine.add_stats_listener(self.on_iteration)
        return self

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SnapshotCollector:
    """Gauges and counters straight from `engine.stats()` at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.m.engine.stats()
        name = self.m.model_name

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("num_requests_running", "Requests with sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests queued and not yet admitted.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).", s.kv_cache_usage)
        yield gauge("kv_cache_pages_used", "KV-cache pages in use.", s.kv_pages_used)
        yield gauge("kv_cache_pages_total", "KV-cache pages in the pool.", s.kv_pages_total)
        yield gauge("kv_cache_page_size", "Tokens per KV-cache page (the block size of prefix caching).",
                    s.page_size)
        yield counter("num_preemptions", "Sequences preempted (their pages freed, to be recomputed).",
                      s.num_preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hit_tokens)
        yield counter("prompt_tokens", "Prompt tokens of requests that started generating.", s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("num_steps", "Engine steps run.", s.num_steps)
        w = getattr(s, "warmup", None)
        if w is not None:
            yield gauge("warmup_step_executables", "Step buckets the warm-up compiles.", w.total)
            yield gauge("warmup_step_executables_compiled", "Of those, compiled so far (the rest compile in the "
                        "background while the server serves).", w.compiled)
            yield gauge("warmup_step_executables_quick", "Of those, compiled quickly (slower steps) and waiting "
                        "for their full compile in the background.", w.quick)
            yield counter("steps_in_larger_bucket", "Steps run in a larger bucket than their own because their "
                          "own was not compiled yet.", w.steps_in_larger_bucket)
            yield counter("compiles_after_ready", "Step buckets compiled on demand after warm-up (0 unless a "
                          "shape escaped the bucket set).", w.compiles_after_ready)
        sd = getattr(s, "spec_decode", None)
        if sd is not None:  # speculative decoding (vLLM's names)
            yield counter("spec_decode_num_drafts", "Sequence-steps that verified drafted tokens.", sd.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Drafted tokens verified by the target.",
                          sd.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.",
                          sd.num_accepted_tokens)
            yield counter("spec_decode_num_emitted_tokens", "Tokens produced by verifying passes "
                          "(accepted drafts plus one per pass).", sd.num_emitted_tokens)
            yield gauge("spec_decode_draft_acceptance_rate", "Accepted / drafted tokens since start.",
                        sd.acceptance_rate)
            yield gauge("spec_decode_mean_tokens_per_pass", "Tokens per target pass of a verifying sequence.",
                        sd.mean_tokens_per_pass)
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Drafted tokens accepted, by draft position.",
                                          labels=["model_name", "position"])
            for j, count in enumerate(sd.accepted_per_position):
                per_pos.add_metric([name, str(j)], count)
            yield per_pos
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        reasons = dict.fromkeys(FINISH_REASONS, 0)
        reasons.update(s.finished_by_reason)
        for reason, count in sorted(reasons.items()):
            success.add_metric([name, str(reason)], count)
        yield success
        if getattr(s, "lora", None) is not None:
            yield from _lora_metrics(name, s.lora)
        util = self.m.window.utilization() if self.m.window is not None else None
        if util is not None:
            yield gauge("model_bandwidth_utilization",
                        "MBU over the last window: (weights per step + live KV) bytes read per second / peak "
                        "device bandwidth.", util[0])
            yield gauge("model_flops_utilization",
                        "MFU over the last window: model FLOPs per second / peak dense bf16 FLOP/s.", util[1])


def _lora_metrics(model_name: str, info: dict):
    """LoRA adapters: vLLM's `lora_requests_info` gauge, which routers (the Gateway API inference extension,
    llm-d, Dynamo) read to send an adapter's requests where it is loaded: its labels name the adapters of
    running and of waiting requests (comma-separated) and `max_lora`, and its value is the time they were
    read, as vLLM sets it; and the requests admitted per adapter."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
    g = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.", labels=labels)
    g.add_metric([info[k] for k in labels], time.time())
    yield g
    c = CounterMetricFamily(PREFIX + "lora_requests", "Requests admitted per LoRA adapter.",
                            labels=["model_name", "lora_name"])
    for lora_name, count in sorted(info["requests_total"].items()):
        c.add_metric([model_name, lora_name], count)
    yield c
