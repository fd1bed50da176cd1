"""Prometheus metrics on a registry of our own (so tests and embedders never collide with the
process-wide default one).

Latencies are observed as the engine client delivers each step's outputs. Pool and queue sizes
and the engine's cumulative counters are read at scrape time, from one snapshot the engine core
takes between two steps (its `stats` call), so they never disagree with each other.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spanserve.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)
REUSE_KINDS = ("prefix", "perforated", "segment", "computed")


class _EngineCollector(Collector):
    """Families read from the engine core's last stats snapshot (engine/core.py's `stats` call),
    which the /metrics route asks for before it renders."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        total, free = s["blocks_total"], s["blocks_free"]
        for name, doc, value in (
            ("spanserve_kv_blocks_total", "KV blocks in the pool", total),
            ("spanserve_kv_blocks_free", "KV blocks not held by any request (cached ones included)", free),
            ("spanserve_kv_blocks_used", "KV blocks held by at least one request", total - free),
            ("spanserve_kv_blocks_cached", "KV blocks published in the reuse index (held or free)", s["blocks_cached"]),
            ("spanserve_kv_block_size_tokens", "tokens per KV block", s["block_size"]),
            ("spanserve_requests_running", "requests scheduled in the running batch", s["running"]),
            ("spanserve_requests_waiting", "requests queued for admission", s["waiting"]),
            ("spanserve_max_num_seqs", "requests the running batch may hold", s["max_num_seqs"]),
            ("spanserve_segments_pinned", "segments pinned through /v1/segments or LLMEngine.pin", s["pinned_segments"]),
            ("spanserve_kv_blocks_pinned", "KV blocks held by pinned segments", s["pinned_blocks"]),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        counters = s["counters"]
        reuse = CounterMetricFamily("spanserve_prompt_tokens_by_reuse",
                                    "prompt tokens of finished requests by how their KV was obtained",
                                    labels=["kind"])
        for kind in REUSE_KINDS:
            reuse.add_metric([kind], counters.get(kind, 0))
        yield reuse
        for name, key, doc in (
            ("spanserve_preemptions", "preemptions", "requests preempted (KV released, recomputed later)"),
            ("spanserve_prompt_tokens", "prompt_tokens", "prompt tokens of admitted requests"),
            ("spanserve_generation_tokens", "generation_tokens", "tokens generated"),
            ("spanserve_engine_requests_finished", "requests_finished", "requests the engine finished"),
        ):
            yield CounterMetricFamily(name, doc, value=counters.get(key, 0))
        yield from _decode_steps(s["decode"])


def _decode_steps(by_batch: dict[Any, dict[str, Any]]) -> Iterator[Metric]:
    """Decode-only steps by batch size: count, wall seconds, KV tokens read (benchmarks/serving.py
    compares them with the bandwidth bound)."""
    fams = [CounterMetricFamily("spanserve_decode_steps", "decode-only engine steps", labels=["batch"]),
            CounterMetricFamily("spanserve_decode_step_seconds", "wall time of decode-only steps", labels=["batch"]),
            CounterMetricFamily("spanserve_decode_kv_tokens", "keys per layer read by decode-only steps",
                                labels=["batch"])]
    for batch, t in sorted(by_batch.items(), key=lambda kv: int(kv[0])):
        for fam, key in zip(fams, ("steps", "seconds", "kv_tokens")):
            fam.add_metric([str(batch)], t[key])
    yield from fams


class ServerMetrics:
    """The registry, and the observer of the engine client's outputs that feeds its latency
    histograms (on the event loop's thread, in step order)."""

    def __init__(self) -> None:
        from spanserve.server.tier_metrics import TierCollector

        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        self._tiers = TierCollector()
        self.registry.register(self._engine)
        self.registry.register(self._tiers)
        self.ttft = Histogram("spanserve_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("spanserve_inter_token_latency_seconds", "time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("spanserve_request_latency_seconds", "arrival to finish of finished requests",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("spanserve_requests_finished", "requests finished, by reason",
                                ["reason"], registry=self.registry)
        # request id -> (tokens seen, time of the last token, first output time); engine thread only
        self._seen: dict[str, tuple[int, float, float]] = {}

    # ---- EngineObserver (the client's outputs) --------------------------------------------
    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None:
        for out in outputs:
            n = len(out.token_ids)
            prev = self._seen.get(out.request_id)
            if prev is None:
                if n:
                    ttft = out.metrics.get("ttft")
                    self.ttft.observe(ttft if ttft is not None else 0.0)
                    # TTFT is arrival-relative; keep arrival so e2e uses the same origin.
                    start = now - (ttft or 0.0)
                    self._seen[out.request_id] = (n, now, start)
            else:
                seen, last, start = prev
                if n > seen:
                    gap = (now - last) / (n - seen)
                    for _ in range(n - seen):
                        self.itl.observe(gap)
                    self._seen[out.request_id] = (n, now, start)
            if out.finished:
                done = self._seen.pop(out.request_id, None)
                if done is not None:
                    self.e2e.observe(now - done[2])
                self.finished.labels(reason=out.finish_reason or "unknown").inc()

    def on_abort(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self.finished.labels(reason="abort").inc()

    # ---- scrape ---------------------------------------------------------------------------
    def render(self, stats: dict[str, Any]) -> bytes:
        """The page, with the engine's families from `stats` (the core's `stats` call)."""
        self._engine.stats = stats
        self._tiers.stats, self._tiers.counters = stats.get("tiers"), stats.get("counters", {})
        return generate_latest(self.registry)
