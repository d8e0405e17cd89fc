"""Prometheus metrics of a flashpage server (``GET /metrics``), one registry per server.

Engine figures (requests running / waiting, KV blocks, prefix hit rate, preemptions, generated
tokens) are read from the engine's latest snapshot at scrape time; latencies (time to first
token, inter-token latency, end-to-end) and finished requests are recorded as outputs are
delivered, on the engine thread (prometheus_client is thread-safe). ``flashpage_engine_restarts_total``
counts engine processes started to replace one that died; the engine's own counters (steps, tokens,
preemptions) start again from 0 in a new engine process, which Prometheus' ``rate()`` reads as a reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flashpage.engine import EngineStats, RequestOutput
from flashpage.serve.async_engine import TokenEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], restarts: Callable[[], int]) -> None:
        self._stats = stats
        self._restarts = restarts

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "flashpage_num_requests_running": ("Requests (sequences) being computed.", s.running),
            "flashpage_num_requests_waiting": ("Requests (sequences) queued, not yet running.", s.waiting),
            "flashpage_kv_blocks_total": ("KV blocks in the pool.", s.blocks_total),
            "flashpage_kv_blocks_used": ("KV blocks owned by running sequences.", s.blocks_used),
            "flashpage_kv_blocks_free": ("KV blocks free (not counting cached ones).", s.blocks_free),
            "flashpage_kv_blocks_cached": ("Freed KV blocks kept for prefix hits (evictable).", s.blocks_cached),
            "flashpage_prefix_cache_hit_rate": ("Share of prompt blocks served by the prefix cache.",
                                                s.prefix_cache_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "flashpage_num_preemptions": ("Sequences preempted (recomputed later) for lack of KV blocks.",
                                          s.preemptions),
            "flashpage_generation_tokens": ("Tokens generated.", s.generated_tokens),
            "flashpage_engine_steps": ("Engine steps (packed forwards).", s.steps),
            "flashpage_engine_restarts": ("Engine processes started to replace one that died.", self._restarts()),
            # speculative decoding (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens)
            "flashpage_spec_decode_num_drafts": ("Speculative proposals verified (one per sequence and step).",
                                                 s.spec_verifications),
            "flashpage_spec_decode_num_draft_tokens": ("Speculative tokens proposed and verified.",
                                                       s.spec_proposed_tokens),
            "flashpage_spec_decode_num_accepted_tokens": ("Speculative tokens accepted.", s.spec_accepted_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


_REFUSAL_COUNTED: ContextVar[bool] = ContextVar("flashpage_refusal_counted", default=False)


class _Refusal:
    def __init__(self, child: Any) -> None:
        self._child = child

    def inc(self) -> None:
        self._child.inc()
        _REFUSAL_COUNTED.set(True)  # this request (asyncio task) is counted: the error handler adds nothing


class RefusalCounter:
    """``flashpage_requests_rejected_total{reason}``: refused requests, each counted once. The route that
    refuses a request counts it with its own reason (``.labels(reason=...).inc()``); any other refusal an
    HTTP error handler sees (unparsable body, unknown model, a field out of range) is counted there by
    :meth:`count_uncounted`, so every refused request shows up."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter("flashpage_requests_rejected", "Requests refused before queueing, by reason.",
                               ["reason"], registry=registry)

    def labels(self, reason: str) -> _Refusal:
        return _Refusal(self.counter.labels(reason=reason))

    def count_uncounted(self, reason: str) -> None:
        """Count the current request under ``reason`` unless its route already counted it."""
        if not _REFUSAL_COUNTED.get():
            self.labels(reason).inc()


class ServeMetrics:
    """The registry and the recorders the engine front calls. ``restarts``: the engine's restart count
    (``EngineProcess.restarts``; default none)."""

    def __init__(self, stats: Callable[[], EngineStats], restarts: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, restarts))
        r = self.registry
        self.ttft = Histogram("flashpage_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("flashpage_inter_token_latency_seconds", "Time between two outputs of a request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("flashpage_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("flashpage_request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("flashpage_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.failed = Counter("flashpage_request_failures",
                              "Requests ended by a failed engine step or a dead engine process.", registry=r)
        self.rejected = RefusalCounter(r)

    def on_tokens(self, event: TokenEvent) -> None:
        (self.ttft if event.first else self.itl).observe(event.seconds)

    def on_finish(self, out: RequestOutput) -> None:
        self.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        m = out.metrics
        if m.finish_time is not None:
            self.e2e.observe(max(0.0, m.finish_time - m.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
