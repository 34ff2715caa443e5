"""Prometheus metrics of the API process (prometheus_client, one registry per app).

API-side series are measured here; engine-side series are exported from the coordinator's
latest EngineStats at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tapserve.api.wire import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineStatsCollector(Collector):
    """Exports the newest EngineStats (read through `get_stats`) at scrape time."""

    def __init__(self, get_stats: Callable[[], EngineStats]):
        self.get_stats = get_stats

    def collect(self) -> Iterator:
        s = self.get_stats()
        gauges = {
            "tapserve_num_requests_running": ("Requests running in the engine", s.num_running),
            "tapserve_num_requests_waiting": ("Requests waiting in the engine", s.num_waiting),
            "tapserve_kv_blocks_used": ("KV cache blocks in use", s.kv_blocks_used),
            "tapserve_kv_blocks_total": ("KV cache blocks in all", s.kv_blocks_total),
            "tapserve_prefix_cache_hit_rate": (
                "Prefix cache hits / queries (tokens), since start",
                s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "tapserve_prefix_cache_queries": (
                "Prefix cache queries (tokens)",
                s.prefix_cache_queries,
            ),
            "tapserve_prefix_cache_hits": ("Prefix cache hits (tokens)", s.prefix_cache_hits),
            "tapserve_custom_output_calls": ("Custom output handler calls", s.custom_output_calls),
            "tapserve_custom_output_errors": (
                "Custom output handler forward() calls that failed (a raise or an output that "
                "breaks the rules; 606 for every request with rows in the call)",
                s.custom_output_errors,
            ),
            "tapserve_custom_output_rows": (
                "Rows of multi-row custom outputs sent to the API process",
                s.custom_output_rows,
            ),
            "tapserve_custom_output_bytes": (
                "Bytes of multi-row custom output rows sent to the API process",
                s.custom_output_bytes,
            ),
            "tapserve_content_filter_finishes": (
                "Sequences a custom output head's should_stop ended (finish_reason "
                '"content_filter")',
                s.custom_output_content_filter,
            ),
            "tapserve_custom_output_should_stop_errors": (
                "Custom output handler should_stop() calls that failed (606 for every request "
                "with rows in the call)",
                s.custom_output_should_stop_errors,
            ),
            "tapserve_engine_steps": ("Engine steps that ran a forward", s.engine_steps),
            "tapserve_engine_steps_ahead": (
                "Engine steps launched before the previous step's tokens reached the host "
                "(asynchronous scheduling)",
                s.engine_steps_ahead,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        selector = CounterMetricFamily(
            "tapserve_custom_output_selector_failures",
            "Requests refused because the custom output selector raised: code 605 for a "
            "ValueError (bad custom_output_params), 606 for any other exception",
            labels=["code"],
        )
        selector.add_metric(["605"], s.custom_output_selector_invalid)
        selector.add_metric(["606"], s.custom_output_selector_errors)
        yield selector


class ApiMetrics:
    """All metrics of one app instance."""

    def __init__(self, get_stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tapserve_requests",
            "HTTP generation requests by final status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("tapserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter(
            "tapserve_generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "tapserve_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tapserve_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tapserve_e2e_request_latency_seconds",
            "Request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "tapserve_api_requests_in_flight",
            "Engine requests the API process waits on",
            registry=r,
        )
        r.register(EngineStatsCollector(get_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
