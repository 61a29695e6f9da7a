"""The host KV tier on /metrics: what it holds, what it moved, how preemptions were resolved, restore latency.

Read from `EngineStats.host_kv` (a `serving.core.host_kv_tier.HostTierStats`) at scrape time; present only
when the engine runs the tier (`--kv_offload_bytes`). Kept apart from `http_metrics` so the tier's metrics
are one block there.
"""

from __future__ import annotations


def families(st, prefix: str, model_name: str):
    """Prometheus metric families of one `HostTierStats` snapshot, labelled with `model_name`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    from serving.core.host_kv_tier import RESTORE_LATENCY_BUCKETS  # (imports jax: only with a tier to show)

    def gauge(metric, doc, value):
        g = GaugeMetricFamily(prefix + metric, doc, labels=["model_name"])
        g.add_metric([model_name], value)
        return g

    def counter(metric, doc, value):
        c = CounterMetricFamily(prefix + metric, doc, labels=["model_name"])
        c.add_metric([model_name], value)
        return c

    yield gauge("host_kv_cache_pages_used", "Pages held by the host KV tier.", st.used_pages)
    yield gauge("host_kv_cache_pages_total", "Pages the host KV tier holds at most.", st.capacity_pages)
    yield gauge("host_kv_cache_bytes_used", "Bytes of KV held by the host KV tier.", st.used_bytes)
    yield gauge("host_kv_cache_bytes_total", "Bytes of the host KV tier's page pool.", st.capacity_bytes)
    yield gauge("host_kv_cache_usage_perc", "Fraction of the host KV tier's pages in use (1 = full).",
                st.used_pages / st.capacity_pages if st.capacity_pages else 0.0)
    yield counter("host_kv_pages_offloaded", "KV pages copied from the device pool into the host tier.",
                  st.pages_offloaded)
    yield counter("host_kv_pages_dropped", "KV pages that found no room in the host tier (all pinned).",
                  st.pages_dropped)
    yield counter("host_kv_pages_restored", "KV pages written back from the host tier into the device pool.",
                  st.pages_restored)
    yield counter("host_kv_restore_hit_tokens", "Tokens whose K/V was restored from the host tier instead of "
                  "recomputed (also counted in prefix_cache_hits).", st.restore_hit_tokens)
    moved = CounterMetricFamily(prefix + "host_kv_bytes_moved", "Bytes copied between the device pool and the "
                                "host tier, by direction.", labels=["model_name", "direction"])
    moved.add_metric([model_name, "to_host"], st.bytes_to_host)
    moved.add_metric([model_name, "to_device"], st.bytes_to_device)
    yield moved
    modes = CounterMetricFamily(prefix + "num_preemptions_by_mode", "Preempted sequences by what became of "
                                "their KV: swapped to the host tier or left to be recomputed.",
                                labels=["model_name", "mode"])
    modes.add_metric([model_name, "swap"], st.preemptions_swap)
    modes.add_metric([model_name, "recompute"], st.preemptions_recompute)
    yield modes
    if st.bandwidth_bytes_per_s:
        yield gauge("host_kv_copy_bandwidth_bytes_per_s", "Measured host<->device copy rate (auto preemption's "
                    "cost model).", st.bandwidth_bytes_per_s)
    if st.recompute_tokens_per_s:
        yield gauge("host_kv_recompute_tokens_per_s", "Measured step rate in tokens per second (auto "
                    "preemption's cost model).", st.recompute_tokens_per_s)
    hist = HistogramMetricFamily(prefix + "host_kv_restore_latency_seconds", "Host seconds to read one step's "
                                 "restored pages from the host tier and dispatch their scatter.",
                                 labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip(list(RESTORE_LATENCY_BUCKETS) + [float("inf")], st.restore_latency_counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    hist.add_metric([model_name], buckets, st.restore_latency_sum)
    yield hist
