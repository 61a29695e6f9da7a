"""The router's /metrics: where requests went, how much of their prompts the index matched, failures, KV shipping.

    ridgeline:router_requests_routed{worker,policy}      requests sent to each worker (retries included; in
                                                         disaggregated mode prefill picks are kv_aware, decode
                                                         picks least_loaded; sticky: to the worker
                                                         holding a stored response)
    ridgeline:router_prompt_tokens{worker}               prompt tokens routed
    ridgeline:router_prefix_matched_tokens{worker}       of those, tokens the index said the worker held
    ridgeline:router_prefix_hit_rate                     matched / prompt tokens, all workers, since start
    ridgeline:router_upstream_errors{worker,kind}        connect / status_5xx / stream / health failures
    ridgeline:router_retries                             requests retried on another worker
    ridgeline:router_requests_failed                     requests answered with an error after the retry
    ridgeline:router_in_flight{worker}                   requests the router has open at each worker
    ridgeline:router_worker_healthy{worker}              1 in rotation, 0 out
    ridgeline:router_kv_transfer_bytes{prefill,decode}   KV bytes shipped prefill -> decode (disaggregated)
    ridgeline:router_kv_transfer_seconds                 histogram of the time one shipment took
"""

from __future__ import annotations

PREFIX = "ridgeline:"

_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(self, policy: str):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        prometheus_client.disable_created_metrics()
        self.policy = policy
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter(PREFIX + "router_requests_routed", "Requests sent to each worker.",
                              ["worker", "policy"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "router_prompt_tokens", "Prompt tokens routed to each worker.",
                                     ["worker"], registry=r)
        self.matched_tokens = Counter(PREFIX + "router_prefix_matched_tokens",
                                      "Routed prompt tokens the prefix index said the worker holds.",
                                      ["worker"], registry=r)
        self.hit_rate = Gauge(PREFIX + "router_prefix_hit_rate",
                              "Prompt tokens matched by the index / prompt tokens routed, since start.", registry=r)
        self.errors = Counter(PREFIX + "router_upstream_errors", "Upstream failures by worker and kind.",
                              ["worker", "kind"], registry=r)
        self.retries = Counter(PREFIX + "router_retries", "Requests retried on another worker.", registry=r)
        self.failed = Counter(PREFIX + "router_requests_failed",
                              "Requests that ended in an error from the router after the retry.", registry=r)
        self.in_flight = Gauge(PREFIX + "router_in_flight", "Requests open at each worker.", ["worker"], registry=r)
        self.healthy = Gauge(PREFIX + "router_worker_healthy", "1 when the worker is in rotation.", ["worker"],
                             registry=r)
        self.kv_bytes = Counter(PREFIX + "router_kv_transfer_bytes", "KV bytes shipped from prefill to decode.",
                                ["prefill", "decode"], registry=r)
        self.kv_seconds = Histogram(PREFIX + "router_kv_transfer_seconds", "Seconds one KV shipment took.",
                                    buckets=_TRANSFER_BUCKETS, registry=r)
        self._prompt_total = 0
        self._matched_total = 0

    def add_worker(self, url: str, policy: str | None = None) -> None:
        self.healthy.labels(url).set(1)
        self.in_flight.labels(url).set(0)
        self.routed.labels(url, policy or self.policy)

    def set_health(self, url: str, up: bool) -> None:
        self.healthy.labels(url).set(1 if up else 0)

    def on_routed(self, url: str, prompt_tokens: int, matched_tokens: int, policy: str | None = None) -> None:
        self.routed.labels(url, policy or self.policy).inc()
        self.prompt_tokens.labels(url).inc(prompt_tokens)
        self.matched_tokens.labels(url).inc(matched_tokens)
        self._prompt_total += prompt_tokens
        self._matched_total += matched_tokens
        self.hit_rate.set(self._matched_total / self._prompt_total if self._prompt_total else 0.0)

    def on_error(self, url: str, kind: str) -> None:
        self.errors.labels(url, kind).inc()

    def on_transfer(self, prefill: str, decode: str, num_bytes: float, seconds: float) -> None:
        self.kv_bytes.labels(prefill, decode).inc(num_bytes)
        self.kv_seconds.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
