"""The router's view of its workers: health, load scraped from /metrics, taking them out and back in.

A background task scrapes every worker's `/metrics` each `interval_s`
(running and waiting requests, KV usage, pool size in pages). A worker whose
scrape fails, or that a request found failing (connection error, HTTP 5xx),
leaves the rotation at once and its prefix-index entries are dropped; while
out, it is probed (`/health`, then `/metrics`) on the same schedule and comes
back on the first success.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable, Optional

import httpx

from serving.routing.router_index import PrefixIndex, WorkerLoad

log = logging.getLogger("ridgeline.router")

_GAUGES = {
    "vllm:num_requests_running": "running",  # vLLM's names, so a vLLM worker is read the same way
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_worker_metrics(text: str) -> dict[str, float]:
    """The load figures of a worker's Prometheus text: running, waiting, kv_usage, pages_total, page_size."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _GAUGES:
                out[_GAUGES[sample.name]] = sample.value
            elif sample.name == "ridgeline:kv_cache_pages_total":
                out["pages_total"] = sample.value
            elif sample.name == "ridgeline:kv_cache_page_size":
                out["page_size"] = sample.value
    return out


class WorkerPool:
    """A named group of workers (the replicas, or a prefill or decode pool) and their state."""

    def __init__(self, urls: Iterable[str], index: Optional[PrefixIndex] = None, metrics=None, role: str = "worker"):
        self.workers = {u.rstrip("/"): WorkerLoad(u.rstrip("/")) for u in urls}
        if not self.workers:
            raise ValueError(f"no {role} URLs given")
        self.index, self.metrics, self.role = index, metrics, role
        self.last_error: dict[str, str] = {}
        self.on_page_size = None  # called with (url, page size) when a worker reports a new one

    def __iter__(self):
        return iter(self.workers.values())

    def loads(self) -> list[WorkerLoad]:
        return list(self.workers.values())

    def healthy(self) -> list[WorkerLoad]:
        return [w for w in self.workers.values() if w.healthy]

    def mark_failed(self, url: str, reason: str) -> None:
        w = self.workers[url]
        if w.healthy:
            log.warning("%s %s out of rotation: %s", self.role, url, reason)
        w.healthy = False
        self.last_error[url] = reason
        if self.index is not None:
            self.index.forget(url)
        if self.metrics is not None:
            self.metrics.set_health(url, False)

    def _mark_up(self, url: str, figures: dict[str, float]) -> None:
        w = self.workers[url]
        if not w.healthy:
            log.info("%s %s back in rotation", self.role, url)
            if self.metrics is not None:
                self.metrics.set_health(url, True)
        w.healthy = True
        w.running = int(figures.get("running", 0))
        w.waiting = int(figures.get("waiting", 0))
        w.kv_usage = float(figures.get("kv_usage", 0.0))
        if self.index is not None and figures.get("pages_total"):
            self.index.set_capacity(url, int(figures["pages_total"]))
        size = int(figures.get("page_size", 0))
        if size and size != w.page_size:
            w.page_size = size
            if self.on_page_size is not None:
                self.on_page_size(url, size)

    async def check(self, client: httpx.AsyncClient, url: str, timeout_s: float = 5.0) -> bool:
        """Probes /health (a draining worker answers 503 there, while /metrics stays open) and scrapes
        /metrics of one worker; updates its state."""
        try:
            r = await client.get(url + "/health", timeout=timeout_s)
            if r.status_code != 200:
                raise RuntimeError(f"/health answered {r.status_code}")
            r = await client.get(url + "/metrics", timeout=timeout_s)
            if r.status_code != 200:
                raise RuntimeError(f"/metrics answered {r.status_code}")
            figures = parse_worker_metrics(r.text)
        except Exception as e:  # noqa: BLE001 - any failure takes the worker out
            self.mark_failed(url, f"health check: {type(e).__name__}: {e}")
            return False
        self._mark_up(url, figures)
        return True

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(self.check(client, u, timeout_s) for u in self.workers))

    async def run_checks(self, client: httpx.AsyncClient, interval_s: float) -> None:
        """Scrapes and probes forever, the first time one interval from now (cancel the task to stop)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all(client, timeout_s=max(1.0, interval_s))
