"""Live figures: the ``/v1/cache`` report and the Prometheus metrics of one app.

Everything lives in a per-app ``CollectorRegistry`` (no module-level state), so several
apps in one process (tests) never share a counter.

Gauges and cumulative engine counters are read from one ``EngineStats`` snapshot per
scrape (taken between two steps); latency histograms are observed as outputs arrive,
using the time each step ended.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.engine.llm_engine import EngineStats

PREFIX = "pagedllm"
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_WASTES = ("internal", "external", "duplication")


def _waste_entry(waste: Any, kind: str) -> dict[str, Any]:
    """``{"tokens": ..., "fraction": ...}`` for one kind of waste of a ``WasteReport``
    (``EngineStats.waste``); None values when the engine could not measure it."""
    if waste is None:
        return {"tokens": None, "fraction": None}
    tokens = getattr(waste, f"{kind}_tokens")
    if tokens is None:  # duplication needs every live request's token ids
        return {"tokens": None, "fraction": None}
    return {"tokens": tokens, "fraction": float(getattr(waste, f"{kind}_fraction"))}


def cache_report(stats: EngineStats) -> dict[str, Any]:
    """The ``/v1/cache`` JSON built from one ``LLMEngine.get_stats()`` snapshot (its
    ``waste`` is computed by the engine, on the step thread)."""
    cache, waste = stats.cache, stats.waste
    queries, hits = cache.prefix_queries_tokens, cache.prefix_hits_tokens
    return {
        "block_size": cache.block_size,
        "blocks_total": cache.blocks_total,
        "blocks_used": cache.blocks_used,
        "blocks_cached_free": cache.blocks_cached_free,
        "blocks_free": cache.blocks_free,
        "usage": cache.blocks_used / cache.blocks_total if cache.blocks_total else 0.0,
        "host_blocks_total": cache.host_blocks_total,
        "host_blocks_used": cache.host_blocks_used,
        "waste": {kind: _waste_entry(waste, kind) for kind in _WASTES},
        "headroom_tokens": None if waste is None else waste.headroom_tokens,
        "disk": _disk_entry(stats),
        "prefix_cache": {
            "queries_tokens": queries,
            "hits_tokens": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "inflight_shared_tokens": stats.num_inflight_shared_tokens,
            "inflight_waits": stats.num_inflight_waits,
        },
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "swapped": stats.num_swapped,
        "preemptions": {
            "recompute": stats.num_preemptions_recompute,
            "swap": stats.num_preemptions_swap,
        },
    }


def _disk_entry(stats: EngineStats) -> dict[str, Any] | None:
    """The disk tier's part of the report (None without one)."""
    cache, disk = stats.cache, stats.disk
    if disk is None:
        return None
    return {
        "path": disk.path,
        "blocks_total": cache.disk_blocks_total,
        "blocks_used": cache.disk_blocks_used,
        "bytes_total": cache.disk_blocks_total * disk.file_nbytes,
        "bytes_used": cache.disk_blocks_used * disk.file_nbytes,
        "hits_tokens_ram": cache.prefix_hits_tokens - cache.prefix_disk_hits_tokens,
        "hits_tokens_disk": cache.prefix_disk_hits_tokens,
        "blocks_read": disk.blocks_read,
        "blocks_written": disk.blocks_written,
        "bytes_read": disk.bytes_read,
        "bytes_written": disk.bytes_written,
        "loads": disk.loads,
        "load_seconds": disk.load_seconds,
        "misses_corrupt": disk.misses_corrupt,
        "write_errors": disk.write_errors,
        "writes_queued": disk.writes_queued,
    }


class _StatsCollector(Collector):
    """Gauges and engine-side counters from the latest ``/v1/cache`` report."""

    def __init__(self) -> None:
        self.report: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        r = self.report
        if r is None:
            return
        for state in ("running", "waiting", "swapped"):
            yield _gauge(f"num_requests_{state}", f"Requests {state}.", r[state])
        server = r.get("server")
        if server is not None:
            yield _gauge(
                "num_requests_queued",
                "Accepted requests still waiting for their first token (bounded).",
                server["queued"],
            )
        for name in ("blocks_total", "blocks_used", "blocks_cached_free", "blocks_free"):
            yield _gauge(f"kv_{name}", f"KV cache {name.replace('_', ' ')}.", r[name])
        yield _gauge("kv_cache_usage", "Fraction of KV blocks held by live requests.", r["usage"])
        yield _gauge("kv_block_size", "Tokens per KV block.", r["block_size"])
        yield _gauge("kv_host_blocks_used", "Host (swap) blocks in use.", r["host_blocks_used"])
        yield _labelled_gauge("kv_waste_tokens", "KV tokens wasted, by kind.", r["waste"], "tokens")
        yield _labelled_gauge(
            "kv_waste_fraction", "Fraction of KV wasted, by kind.", r["waste"], "fraction"
        )
        prefix = r["prefix_cache"]
        yield _counter(
            "prefix_cache_queries_tokens", "Prompt tokens looked up.", prefix["queries_tokens"]
        )
        yield _counter(
            "prefix_cache_hits_tokens", "Prompt tokens found cached.", prefix["hits_tokens"]
        )
        yield _counter(
            "prefix_cache_inflight_shared_tokens",
            "Prompt tokens not computed twice: found cached after waiting for another "
            "request that was computing them (in-flight sharing).",
            prefix["inflight_shared_tokens"],
        )
        disk = r.get("disk")
        if disk is not None:
            yield from _disk_metrics(disk)
        preempt = CounterMetricFamily(
            f"{PREFIX}_num_preemptions", "Preemptions, by mode.", labels=["mode"]
        )
        for mode, count in r["preemptions"].items():
            preempt.add_metric([mode], count)
        yield preempt


def _disk_metrics(disk: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("kv_disk_blocks_used", "KV blocks on the disk tier.", disk["blocks_used"])
    yield _gauge(
        "kv_disk_blocks_total", "KV blocks the disk tier holds at most.", disk["blocks_total"]
    )
    yield _gauge("kv_disk_bytes_used", "Bytes of KV blocks on the disk tier.", disk["bytes_used"])
    hits = CounterMetricFamily(
        f"{PREFIX}_prefix_cache_hits_tokens_by_tier",
        "Prompt tokens found cached, by tier.",
        labels=["tier"],
    )
    hits.add_metric(["ram"], disk["hits_tokens_ram"])
    hits.add_metric(["disk"], disk["hits_tokens_disk"])
    yield hits
    yield _counter("kv_disk_read_bytes", "Bytes read from the disk tier.", disk["bytes_read"])
    yield _counter(
        "kv_disk_written_bytes", "Bytes written to the disk tier.", disk["bytes_written"]
    )
    yield _counter("kv_disk_loads", "Steps that loaded blocks from the disk tier.", disk["loads"])
    yield _counter(
        "kv_disk_load_seconds",
        "Time spent loading blocks from the disk tier.",
        disk["load_seconds"],
    )
    yield _counter(
        "kv_disk_misses_corrupt",
        "Disk-tier blocks found truncated or corrupt (recomputed).",
        disk["misses_corrupt"],
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _labelled_gauge(name: str, doc: str, by_kind: dict[str, Any], key: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["kind"])
    for kind, entry in by_kind.items():
        if entry[key] is not None:  # duplication is unknown when token ids are missing
            family.add_metric([kind], entry[key])
    return family


@dataclass(slots=True)
class _Timing:
    arrival: float
    last: float | None = None
    num_tokens: int = 0


def _latency_histogram(registry: CollectorRegistry, name: str, doc: str) -> Histogram:
    """``pagedllm_<name>`` with the shared latency buckets."""
    return Histogram(f"{PREFIX}_{name}", doc, buckets=_LATENCY_BUCKETS, registry=registry)


@dataclass(slots=True)
class ServerMetrics:
    """The metrics of one app: a registry, the stats collector, latency histograms."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _stats: _StatsCollector = field(default_factory=_StatsCollector)
    _timings: dict[str, _Timing] = field(default_factory=dict)
    ttft: Histogram = field(init=False)
    itl: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    generation_tokens: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    finished: Counter = field(init=False)
    rejected: Counter = field(init=False)

    def __post_init__(self) -> None:
        reg = self.registry
        reg.register(self._stats)
        self.ttft = _latency_histogram(
            reg, "time_to_first_token_seconds", "Time from arrival to the first output token."
        )
        self.itl = _latency_histogram(
            reg, "inter_token_latency_seconds", "Time between two output steps of one request."
        )
        self.e2e = _latency_histogram(
            reg, "e2e_request_latency_seconds", "Time from arrival to the last token."
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Output tokens generated.", registry=reg
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of requests that started.", registry=reg
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "Requests finished, by reason.",
            ["finish_reason"],
            registry=reg,
        )
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected",
            "Requests answered with an error before reaching the engine, by HTTP status.",
            ["status"],
            registry=reg,
        )

    def request_started(self, request_id: str, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival)

    def request_ended(self, request_id: str, reason: str) -> None:
        """The client side is done with the request (finished, aborted or failed)."""
        if self._timings.pop(request_id, None) is not None:
            self.finished.labels(reason).inc()

    def request_discarded(self, request_id: str) -> None:
        """The request never reached the engine (refused)."""
        self._timings.pop(request_id, None)

    def on_outputs(self, outputs: Sequence[Any], step_time: float) -> None:
        """AsyncEngine listener: latency and token counts from one step's outputs."""
        for output in outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new_tokens = num_tokens - timing.num_tokens
            if new_tokens > 0:
                if timing.last is None:
                    self.ttft.observe(step_time - timing.arrival)
                    self.prompt_tokens.inc(len(output.prompt_token_ids or ()))
                else:
                    self.itl.observe(step_time - timing.last)
                self.generation_tokens.inc(new_tokens)
                timing.last = step_time
                timing.num_tokens = num_tokens
            if output.finished:
                self.e2e.observe(step_time - timing.arrival)

    def render(self, report: dict[str, Any]) -> bytes:
        """The Prometheus text exposition, with gauges from a ``cache_report``."""
        self._stats.report = report
        return generate_latest(self.registry)
