"""Prometheus families of the KV tiers below the pool, from the tiers' own counters as the engine
core copied them (each tier's under its lock, so a scrape sees a consistent set)."""
from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from spanserve.cache.tiers.base import LOAD_BUCKETS

_COUNTERS = (
    ("hits", "spanserve_kv_tier_hits", "blocks a tier gave back"),
    ("misses", "spanserve_kv_tier_misses", "blocks asked of a tier and not given (bad payloads included)"),
    ("bytes_in", "spanserve_kv_tier_bytes_in", "bytes stored into a tier"),
    ("bytes_out", "spanserve_kv_tier_bytes_out", "bytes loaded from a tier"),
    ("bad_payloads", "spanserve_kv_tier_checksum_failures",
     "stored blocks refused on load (checksum, truncation, shape, model or key mismatch)"),
    ("auth_failures", "spanserve_kv_tier_auth_failures",
     "stored blocks whose MAC failed on load (forged, altered, another secret's or copied under another key)"),
    ("errors", "spanserve_kv_tier_errors", "tier batches that failed (store unreachable or timed out)"),
    ("evictions", "spanserve_kv_tier_evictions", "blocks a tier dropped to stay within its size"),
)


class TierCollector(Collector):
    """Families read from the tiers' part of the engine core's stats snapshot (none without tiers)."""

    def __init__(self) -> None:
        self.stats: dict | None = None  # TierStack.stats(), as the core last sent it
        self.counters: dict[str, int] = {}  # the engine's cumulative counters (tokens served per tier)

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        per_tier = stats["tiers"]
        for field, name, doc in _COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, s in per_tier.items():
                fam.add_metric([tier], s[field])
            yield fam
        hist = HistogramMetricFamily("spanserve_kv_tier_load_seconds", "time of one batched load from a tier",
                                     labels=["tier"])
        for tier, s in per_tier.items():
            cum = list(accumulate(s["load_buckets"]))
            buckets = [(str(b), c) for b, c in zip(LOAD_BUCKETS, cum)] + [("+Inf", cum[-1])]
            hist.add_metric([tier], buckets, s["load_sum"])
        yield hist
        served = CounterMetricFamily("spanserve_prompt_tokens_by_tier",
                                     "prompt tokens of finished requests loaded from a tier below the pool",
                                     labels=["tier"])
        counters = self.counters
        for tier in per_tier:
            served.add_metric([tier], counters.get(tier, 0))
        yield served
        yield CounterMetricFamily("spanserve_kv_writebacks_dropped",
                                  "block write-backs dropped because the queue was full", value=stats["dropped_writebacks"])
        yield GaugeMetricFamily("spanserve_kv_writebacks_queued", "blocks captured and waiting to be stored",
                                value=stats["queued_writebacks"])
