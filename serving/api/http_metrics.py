"""The /metrics registry: vLLM's metrics under vLLM's exact names, and what vLLM lacks under `ridgeline:`.

Every exported metric is one row of `METRICS`. Dashboards, alerts and
endpoint pickers built on vLLM's names (`vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, ...) read this server unchanged: same names,
types, help, `model_name` and `engine` labels, and histogram buckets as
vLLM's V1 engine (vllm/v1/metrics/loggers.py).

Besides vLLM's set, the `ridgeline:` metrics: KV pool size in pages and page
size (what the router needs), step and warm-up compile counts, the
speculative-decoding ratios, and two gauges no other engine exports:

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
from typing import Callable, Optional

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
#
# Every exported metric is one row of METRICS: its full name, type, help, where its values come
# from, and (histograms) its buckets. Those vLLM exports are under vLLM's exact names, types,
# labels (`model_name`, `engine`) and buckets (vllm/v1/metrics/loggers.py), so dashboards, alerts
# and endpoint pickers written for vLLM read this server unchanged; what vLLM does not export is
# under `ridgeline:` (labelled `model_name` only).

VLLM = "vllm:"
PREFIX = "ridgeline:"
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets of per-request token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclasses.dataclass(frozen=True)
class Metric:
    """One exported metric.

    `value`: a gauge's or counter's value from an `EngineStats` snapshot (a number, or a dict
    {label values: number} for metrics with `labels`; None leaves the metric out of the scrape);
    a histogram's observations from one step's `IterationStats` (an iterable of numbers); a
    histogram kept by the engine itself ("histogram_snapshot"): (its bucket bounds, counts per
    bucket with the +Inf one last, and their sum) from the snapshot.
    `buckets`: a histogram's upper bounds, or a function of the model's context length.
    """

    name: str  # as exported (a counter gets `_total` appended by the client library)
    kind: str  # "gauge" | "counter" | "histogram" | "histogram_snapshot"
    doc: str
    value: Callable
    buckets: object = None
    labels: tuple = ()  # labels beyond the standard ones
    bare: bool = False  # no standard labels either (vLLM's `lora_requests_info` has only its own)

    @property
    def is_vllm(self) -> bool:
        return self.name.startswith(VLLM)

    @property
    def standard_labels(self) -> tuple[str, ...]:
        if self.bare:
            return ()
        return ("model_name", "engine") if self.is_vllm else ("model_name",)


def _finished(field: str):
    return lambda it: [getattr(f, field) for f in it.finished if getattr(f, field) is not None]


def _per_output_token(it):
    return [f.decode_time / (f.generation_tokens - 1) for f in it.finished
            if f.decode_time is not None and f.generation_tokens > 1]


def _spec(attr: str):
    return lambda s: None if getattr(s, "spec_decode", None) is None else getattr(s.spec_decode, attr)


def _warmup(attr: str):
    return lambda s: None if getattr(s, "warmup", None) is None else getattr(s.warmup, attr)


def _finished_by_reason(s) -> dict:
    reasons = dict.fromkeys(FINISH_REASONS, 0)
    reasons.update(s.finished_by_reason)
    return {(str(r),): n for r, n in sorted(reasons.items())}


def _accepted_per_position(s):
    sd = getattr(s, "spec_decode", None)
    return None if sd is None else {(str(j),): n for j, n in enumerate(sd.accepted_per_position)}


def _host_kv(field):
    """A host-tier row's value: `field` of `EngineStats.host_kv` (a name, or a function of it); None
    (the row left out) when the engine runs no tier."""
    read = field if callable(field) else (lambda h: getattr(h, field))
    return lambda s: None if getattr(s, "host_kv", None) is None else read(s.host_kv)


def _lora_info(s):
    """vLLM's `lora_requests_info`: its labels name the adapters of running and of waiting requests
    (comma-separated) and `max_lora`; its value is the time they were read, as vLLM sets it. Routers
    (the Gateway API inference extension, llm-d, Dynamo) read it to send an adapter's requests where
    it is loaded."""
    info = getattr(s, "lora", None)
    if info is None:
        return None
    return {(info["running_lora_adapters"], info["waiting_lora_adapters"], info["max_lora"]): time.time()}


def _lora_requests(s):
    info = getattr(s, "lora", None)
    return None if info is None else {(name,): n for name, n in sorted(info["requests_total"].items())}


METRICS: tuple[Metric, ...] = (
    # --- vLLM's, read from the engine at scrape time
    Metric(VLLM + "num_requests_running", "gauge", "Number of requests in model execution batches.",
           lambda s: s.num_running),
    Metric(VLLM + "num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           lambda s: s.num_waiting),
    Metric(VLLM + "kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           lambda s: s.kv_cache_usage),
    Metric(VLLM + "prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
           lambda s: s.prefix_cache_queried_tokens),
    Metric(VLLM + "prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           lambda s: s.prefix_cache_hit_tokens),
    Metric(VLLM + "num_preemptions", "counter", "Cumulative number of preemption from the engine.",
           lambda s: s.num_preemptions),
    Metric(VLLM + "prompt_tokens", "counter", "Number of prefill tokens processed.", lambda s: s.prompt_tokens),
    Metric(VLLM + "generation_tokens", "counter", "Number of generation tokens processed.",
           lambda s: s.generation_tokens),
    Metric(VLLM + "request_success", "counter", "Count of successfully processed requests.", _finished_by_reason,
           labels=("finished_reason",)),
    Metric(VLLM + "spec_decode_num_drafts", "counter", "Number of spec decoding drafts.", _spec("num_drafts")),
    Metric(VLLM + "spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", _spec("num_draft_tokens")),
    Metric(VLLM + "spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
           _spec("num_accepted_tokens")),
    Metric(VLLM + "spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
           _accepted_per_position, labels=("position",)),
    # --- vLLM's, fed after every step
    Metric(VLLM + "time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
           lambda it: it.time_to_first_tokens, TTFT_BUCKETS),
    Metric(VLLM + "inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
           lambda it: it.inter_token_latencies, ITL_BUCKETS),
    Metric(VLLM + "request_time_per_output_token_seconds", "histogram",
           "Histogram of time_per_output_token_seconds per request.", _per_output_token, ITL_BUCKETS),
    Metric(VLLM + "e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
           _finished("e2e_latency"), REQUEST_LATENCY_BUCKETS),
    Metric(VLLM + "request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.",
           _finished("queue_time"), REQUEST_LATENCY_BUCKETS),
    Metric(VLLM + "request_inference_time_seconds", "histogram",
           "Histogram of time spent in RUNNING phase for request.", _finished("inference_time"),
           REQUEST_LATENCY_BUCKETS),
    Metric(VLLM + "request_prefill_time_seconds", "histogram",
           "Histogram of time spent in PREFILL phase for request.", _finished("prefill_time"),
           REQUEST_LATENCY_BUCKETS),
    Metric(VLLM + "request_decode_time_seconds", "histogram", "Histogram of time spent in DECODE phase for request.",
           _finished("decode_time"), REQUEST_LATENCY_BUCKETS),
    Metric(VLLM + "request_prompt_tokens", "histogram", "Number of prefill tokens processed.",
           _finished("prompt_tokens"), buckets_1_2_5),
    Metric(VLLM + "request_generation_tokens", "histogram", "Number of generation tokens processed.",
           _finished("generation_tokens"), buckets_1_2_5),
    Metric(VLLM + "request_max_num_generation_tokens", "histogram",
           "Histogram of maximum number of requested generation tokens.", _finished("max_tokens"), buckets_1_2_5),
    Metric(VLLM + "request_params_n", "histogram", "Histogram of the n request parameter.", _finished("n"),
           N_BUCKETS),
    Metric(VLLM + "request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.",
           _finished("max_tokens"), buckets_1_2_5),
    Metric(VLLM + "iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.",
           lambda it: [it.num_tokens] if it.num_tokens else [], ITERATION_TOKEN_BUCKETS),
    # --- what vLLM does not export
    Metric(PREFIX + "kv_cache_pages_used", "gauge", "KV-cache pages in use.", lambda s: s.kv_pages_used),
    Metric(PREFIX + "kv_cache_pages_total", "gauge", "KV-cache pages in the pool.", lambda s: s.kv_pages_total),
    Metric(PREFIX + "kv_cache_page_size", "gauge", "Tokens per KV-cache page (the block size of prefix caching).",
           lambda s: s.page_size),
    Metric(PREFIX + "num_steps", "counter", "Engine steps run.", lambda s: s.num_steps),
    Metric(PREFIX + "warmup_step_executables", "gauge", "Step buckets the warm-up compiles.", _warmup("total")),
    Metric(PREFIX + "warmup_step_executables_compiled", "gauge", "Of those, compiled so far (the rest compile in "
           "the background while the server serves).", _warmup("compiled")),
    Metric(PREFIX + "warmup_step_executables_quick", "gauge", "Of those, compiled quickly (slower steps) and "
           "waiting for their full compile in the background.", _warmup("quick")),
    Metric(PREFIX + "steps_in_larger_bucket", "counter", "Steps run in a larger bucket than their own because "
           "their own was not compiled yet.", _warmup("steps_in_larger_bucket")),
    Metric(PREFIX + "compiles_after_ready", "counter", "Step buckets compiled on demand after warm-up (0 unless a "
           "shape escaped the bucket set).", _warmup("compiles_after_ready")),
    Metric(PREFIX + "spec_decode_num_emitted_tokens", "counter", "Tokens produced by verifying passes (accepted "
           "drafts plus one per pass).", _spec("num_emitted_tokens")),
    Metric(PREFIX + "spec_decode_draft_acceptance_rate", "gauge", "Accepted / drafted tokens since start.",
           _spec("acceptance_rate")),
    Metric(PREFIX + "spec_decode_mean_tokens_per_pass", "gauge", "Tokens per target pass of a verifying sequence.",
           _spec("mean_tokens_per_pass")),
    Metric(PREFIX + "model_bandwidth_utilization", "gauge", "MBU over the last window: (weights per step + live KV) "
           "bytes read per second / peak device bandwidth.", lambda s: s.utilization and s.utilization[0]),
    Metric(PREFIX + "model_flops_utilization", "gauge", "MFU over the last window: model FLOPs per second / peak "
           "dense bf16 FLOP/s.", lambda s: s.utilization and s.utilization[1]),
    Metric(VLLM + "lora_requests_info", "gauge", "Running stats on lora requests.", _lora_info,
           labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"), bare=True),
    # --- what vLLM does not export (continued): LoRA requests per adapter, then the host KV tier
    Metric(PREFIX + "lora_requests", "counter", "Requests admitted per LoRA adapter.", _lora_requests,
           labels=("lora_name",)),
    # --- the host KV tier (--kv_offload_bytes): present only when the engine runs one
    Metric(PREFIX + "host_kv_cache_pages_used", "gauge", "Pages held by the host KV tier.", _host_kv("used_pages")),
    Metric(PREFIX + "host_kv_cache_pages_total", "gauge", "Pages the host KV tier holds at most.",
           _host_kv("capacity_pages")),
    Metric(PREFIX + "host_kv_cache_bytes_used", "gauge", "Bytes of KV held by the host KV tier.",
           _host_kv("used_bytes")),
    Metric(PREFIX + "host_kv_cache_bytes_total", "gauge", "Bytes of the host KV tier's page pool.",
           _host_kv("capacity_bytes")),
    Metric(PREFIX + "host_kv_cache_usage_perc", "gauge", "Fraction of the host KV tier's pages in use (1 = full).",
           _host_kv(lambda h: h.used_pages / h.capacity_pages if h.capacity_pages else 0.0)),
    Metric(PREFIX + "host_kv_pages_offloaded", "counter", "KV pages copied from the device pool into the host tier.",
           _host_kv("pages_offloaded")),
    Metric(PREFIX + "host_kv_pages_dropped", "counter", "KV pages that found no room in the host tier (all pinned).",
           _host_kv("pages_dropped")),
    Metric(PREFIX + "host_kv_pages_restored", "counter", "KV pages written back from the host tier into the device "
           "pool.", _host_kv("pages_restored")),
    Metric(PREFIX + "host_kv_restore_hit_tokens", "counter", "Tokens whose K/V was restored from the host tier "
           "instead of recomputed (also counted in vllm:prefix_cache_hits).", _host_kv("restore_hit_tokens")),
    Metric(PREFIX + "host_kv_bytes_moved", "counter", "Bytes copied between the device pool and the host tier, by "
           "direction.", _host_kv(lambda h: {("to_host",): h.bytes_to_host, ("to_device",): h.bytes_to_device}),
           labels=("direction",)),
    Metric(PREFIX + "num_preemptions_by_mode", "counter", "Preempted sequences by what became of their KV: swapped "
           "to the host tier or left to be recomputed.",
           _host_kv(lambda h: {("swap",): h.preemptions_swap, ("recompute",): h.preemptions_recompute}),
           labels=("mode",)),
    Metric(PREFIX + "host_kv_copy_bandwidth_bytes_per_s", "gauge", "Measured host<->device copy rate (auto "
           "preemption's cost model).", _host_kv(lambda h: h.bandwidth_bytes_per_s or None)),
    Metric(PREFIX + "host_kv_recompute_tokens_per_s", "gauge", "Measured step rate in tokens per second (auto "
           "preemption's cost model).", _host_kv(lambda h: h.recompute_tokens_per_s or None)),
    Metric(PREFIX + "host_kv_restore_latency_seconds", "histogram_snapshot", "Host seconds to read one step's "
           "restored pages from the host tier and dispatch their scatter.",
           _host_kv(lambda h: (h.restore_latency_bounds, h.restore_latency_counts, h.restore_latency_sum))),
)

BY_NAME = {m.name: m for m in METRICS}


class ServerMetrics:
    """The /metrics registry of one server over one `AsyncEngine`, built from `METRICS`.

    Gauges and counters are read from `engine.stats()` when Prometheus
    scrapes, so they can never drift from the engine's own bookkeeping.
    Histograms are fed by a stats listener on the engine thread (`attach`),
    which only does a few bisects per step.
    """

    ENGINE_INDEX = "0"  # vLLM's `engine` label: this server runs one engine core

    def __init__(self, engine, model_name: str, cost: ModelCost | None = None, peak: DevicePeak | None = None,
                 window_s: float = 10.0, max_model_len: int = 8192):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Histogram

        # No `*_created` series: vLLM's endpoint has none, and they double the size of every scrape.
        prometheus_client.disable_created_metrics()
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.window = UtilizationWindow(cost, peak, window_s) if cost is not None else None
        self._cum = [0, 0, 0]  # steps, tokens, kv tokens read (cumulative, engine thread only)
        self.histograms = []  # (Metric, labelled child)
        for m in METRICS:
            if m.kind != "histogram":
                continue
            buckets = m.buckets(max_model_len) if callable(m.buckets) else m.buckets
            h = Histogram(m.name, m.doc, list(m.standard_labels), buckets=[float(b) for b in buckets],
                          registry=self.registry)
            self.histograms.append((m, h.labels(*self.label_values(m))))
        self.registry.register(_SnapshotCollector(self))

    def label_values(self, m: Metric) -> list[str]:
        if m.bare:
            return []
        return [self.model_name, self.ENGINE_INDEX] if m.is_vllm else [self.model_name]

    # Called on the engine thread after every step.
    def on_iteration(self, it) -> None:
        for m, h in self.histograms:
            for x in m.value(it):
                h.observe(x)
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


class _Snapshot:
    """An `EngineStats` plus the MBU/MFU of the window, what the gauge and counter rows read."""

    def __init__(self, stats, utilization):
        self._stats = stats
        self.utilization = utilization

    def __getattr__(self, name):
        return getattr(self._stats, name)


class _SnapshotCollector:
    """Gauges and counters of `METRICS`, straight from `engine.stats()` at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        util = self.m.window.utilization() if self.m.window is not None else None
        s = _Snapshot(self.m.engine.stats(), util)
        for m in METRICS:
            if m.kind == "histogram":
                continue
            value = m.value(s)
            if value is None:
                continue
            if m.kind == "histogram_snapshot":
                yield _histogram_family(HistogramMetricFamily(m.name, m.doc, labels=list(m.standard_labels)),
                                        self.m.label_values(m), *value)
                continue
            family = (GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily)(
                m.name, m.doc, labels=list(m.standard_labels + m.labels))
            base = self.m.label_values(m)
            for extra, v in (value.items() if isinstance(value, dict) else [((), value)]):
                family.add_metric(base + list(extra), v)
            yield family


def _histogram_family(family, labels: list, bounds, counts, total: float):
    """`family` with one sample: per-bucket `counts` (the +Inf bucket last) made cumulative."""
    cumulative, buckets = 0, []
    for bound, count in zip(list(bounds) + [float("inf")], counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    family.add_metric(labels, buckets, total)
    return family
