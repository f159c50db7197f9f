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

from pagedllm.engine.reports import cache_report

__all__ = ["ServerMetrics", "cache_report"]

PREFIX = "pagedllm"
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


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
        for name in (
            "blocks_total",
            "blocks_used",
            "blocks_cached_free",
            "blocks_free",
            "blocks_pinned",
        ):
            yield _gauge(f"kv_{name}", f"KV cache {name.replace('_', ' ')}.", r[name])
        yield _gauge("kv_cache_usage", "Fraction of KV blocks held by live requests.", r["usage"])
        yield _gauge("kv_block_size", "Tokens per KV block.", r["block_size"])
        cap = r.get("max_prefill_tokens_while_decoding")
        if cap is not None:
            yield _gauge(
                "max_prefill_tokens_while_decoding",
                "Most prompt tokens in a step that also decodes, as the scheduler has it now.",
                cap,
            )
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
        yield _counter(
            "kv_pins_given_up",
            "Waiting requests' pins on their cached prefix released to make room.",
            r["pins_given_up"],
        )
        disk = r.get("disk")
        if disk is not None:
            yield from _disk_metrics(disk)
        elastic = r.get("elastic")
        if elastic is not None:
            yield from _elastic_metrics(elastic)
        speculative = r.get("speculative")
        if speculative is not None:
            yield from _speculative_metrics(speculative)
        preempt = CounterMetricFamily(
            f"{PREFIX}_num_preemptions", "Preemptions, by mode.", labels=["mode"]
        )
        for mode, count in r["preemptions"].items():
            preempt.add_metric([mode], count)
        yield preempt


def _elastic_metrics(elastic: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge(
        "kv_cache_bytes", "Bytes of the KV cache's device tier now.", elastic["bytes_total"]
    )
    if elastic["automatic"]:
        block = elastic["bytes_per_block"]
        yield _gauge("kv_cache_min_bytes", "The elastic pool's MIN.", elastic["min_blocks"] * block)
        yield _gauge("kv_cache_max_bytes", "The elastic pool's MAX.", elastic["max_blocks"] * block)
    yield _gauge("kv_cache_resizing", "1 while a shrink is under way.", int(elastic["resizing"]))
    resizes = CounterMetricFamily(
        f"{PREFIX}_kv_cache_resizes", "Resizes by the automatic policy, by kind.", labels=["kind"]
    )
    resizes.add_metric(["grow"], elastic["grows"])
    resizes.add_metric(["shrink"], elastic["shrinks"])
    yield resizes
    last = elastic["last_resize"]
    if last is not None:
        yield _gauge("kv_cache_last_resize_ms", "Duration of the last resize.", last["duration_ms"])
        yield _gauge(
            "kv_cache_last_resize_blocks_moved",
            "Blocks compaction moved in the last resize.",
            last["blocks_moved"],
        )
        yield _gauge(
            "kv_cache_last_resize_bytes_returned",
            "Bytes the last resize gave back (negative: grew).",
            last["bytes_returned"],
        )


def _speculative_metrics(spec: dict[str, Any]) -> Iterator[Metric]:
    yield _counter(
        "spec_decode_num_drafts",
        "Speculative verifications: one sequence's step with drafts.",
        spec["verifications"],
    )
    yield _counter("spec_decode_num_draft_tokens", "Draft tokens verified.", spec["draft_tokens"])
    yield _counter(
        "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec["accepted_tokens"]
    )
    yield _gauge(
        "spec_decode_mean_acceptance_length",
        "Tokens a verification yields on average (accepted drafts and one more).",
        spec["mean_acceptance_length"],
    )


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
    yield _counter(
        "kv_disk_stores_set_aside",
        "Damaged disk stores renamed aside at start-up (the cache started empty).",
        disk["stores_set_aside"],
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
    num_prompt_tokens: int = 0
    last: float | None = None


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

    def request_started(self, request_id: str, arrival: float, num_prompt_tokens: int = 0) -> None:
        self._timings[request_id] = _Timing(arrival, num_prompt_tokens)

    def request_ended(self, request_id: str, reason: str) -> None:
        """The client side is done with the request (finished, aborted or failed)."""
        if self._timings.pop(request_id, None) is not None:
            self.finished.labels(reason).inc()

    def request_discarded(self, request_id: str) -> None:
        """The request never reached the engine (refused)."""
        self._timings.pop(request_id, None)

    def on_outputs(self, deltas: Sequence[Any], step_time: float) -> None:
        """AsyncEngine listener: latency and token counts from one step's ``RequestDelta``s."""
        for delta in deltas:
            timing = self._timings.get(delta.request_id)
            if timing is None:
                continue
            new_tokens = sum(len(s.token_ids) for s in delta.seqs)
            if new_tokens > 0:
                if timing.last is None:
                    self.ttft.observe(step_time - timing.arrival)
                    self.prompt_tokens.inc(timing.num_prompt_tokens)
                else:
                    self.itl.observe(step_time - timing.last)
                self.generation_tokens.inc(new_tokens)
                timing.last = step_time
            if delta.finished:
                self.e2e.observe(step_time - timing.arrival)

    def render(self, report: dict[str, Any]) -> bytes:
        """The Prometheus text exposition, with gauges from a ``cache_report``."""
        self._stats.report = report
        return generate_latest(self.registry)
