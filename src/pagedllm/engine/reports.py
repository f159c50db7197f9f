"""The engine's stats (``EngineStats``) and the reports built from them inside the engine
core, from one consistent snapshot, sent to the server as plain data: the ``/v1/cache``
report, the per-block dashboard report and the cache events' feed.

``EngineStats`` crosses the wire whole (``engine/messages.py`` decodes it from its type
hints), so every type it holds is imported here at run time."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.core.accounting import WasteReport, group_wastes, waste
from pagedllm.core.block_pool import BLOCK_STATE_NAMES
from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.kv_records import CacheStats
from pagedllm.core.request import RequestStatus
from pagedllm.engine.elastic import ElasticStats
from pagedllm.engine.speculator import SpecDecodeStats
from pagedllm.routes import Routes
from pagedllm.worker.base import ResizableRunner
from pagedllm.worker.disk_store import DiskStoreStats

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics and tests (totals count since start-up).

    ``waste.external_tokens`` is measured against the next waiting request (its
    prompt plus ``max_tokens``); 0 when nobody waits.
    """

    num_running: int
    num_waiting: int
    num_swapped: int
    num_unfinished_requests: int
    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_computed_tokens: int
    num_requests_finished: int
    num_requests_failed: int
    num_requests_aborted: int
    kv_cache_usage: float
    max_model_len: int
    cache: CacheStats
    # Prompt tokens found cached that another request was computing when this one
    # arrived (in-flight sharing), and how many requests waited for such blocks.
    num_inflight_shared_tokens: int = 0
    num_inflight_waits: int = 0
    # Waiting requests' pins on their cached prefix released for another's room.
    num_pins_given_up: int = 0
    # Internal, external and duplication waste of the device tier now
    # (``core.accounting.waste``); computed by ``get_stats`` only.
    waste: WasteReport | None = None
    # A model with KV cache groups (local and global layers): each group's waste, in group
    # order (``waste`` sums them); empty for one group.
    group_waste: tuple[WasteReport, ...] = ()
    # The disk tier's I/O totals (None without one); its blocks and hits are in `cache`.
    disk: DiskStoreStats | None = None
    # The elastic pool (sizes, policy, last resize); None for a runner that cannot resize.
    elastic: ElasticStats | None = None
    # Which implementation runs each capability of a step, and the dtype (None: no model).
    routes: Routes | None = None
    # The cache's format ("bfloat16", "int8", ...) and bytes per token with its scales;
    # None for a runner without a KV spec (the fake runner).
    kv_cache_dtype: str | None = None
    kv_bytes_per_token: float | None = None
    # Most prompt tokens in a step that also decodes, as the scheduler has it now (set from
    # measured step times with max_prefill_time_while_decoding_s); None: the step's budget.
    max_prefill_tokens_while_decoding: int | None = None
    # Speculative decoding's totals (drafts, accepted, mean acceptance length); None: off.
    speculative: SpecDecodeStats | None = None


@dataclass(slots=True)
class EngineCounters:
    """The totals the step loop keeps since start-up (``EngineStats`` reports them)."""

    steps: int = 0  # model steps (a multi-step schedule counts each)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0


def engine_stats(engine: LLMEngine) -> EngineStats:
    """``LLMEngine.get_stats()``: one snapshot of the scheduler, the cache and the counters."""
    s = engine.scheduler.stats()
    c = engine.counters
    kv = engine.kv
    waste_inputs = _waste_inputs(engine)  # one pass over the live tokens for both wastes
    return EngineStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_swapped=s.num_swapped,
        num_unfinished_requests=engine.get_num_unfinished_requests(),
        num_preemptions=s.num_preemptions,
        num_preemptions_recompute=s.num_preemptions_recompute,
        num_preemptions_swap=s.num_preemptions_swap,
        num_steps=c.steps,
        num_prompt_tokens=c.prompt_tokens,
        num_generation_tokens=c.generation_tokens,
        num_computed_tokens=c.computed_tokens,
        num_requests_finished=c.finished,
        num_requests_failed=c.failed,
        num_requests_aborted=c.aborted,
        kv_cache_usage=kv.usage,
        max_prefill_tokens_while_decoding=engine.max_prefill_tokens_while_decoding,
        max_model_len=engine.max_model_len,
        cache=kv.stats(),
        num_inflight_shared_tokens=s.num_inflight_shared_tokens,
        num_inflight_waits=s.num_inflight_waits,
        num_pins_given_up=s.num_pins_given_up,
        waste=waste(kv, *waste_inputs),
        group_waste=tuple(group_wastes(kv, *waste_inputs))
        if isinstance(kv, HybridKVCacheManager)
        else (),
        disk=engine.disk_store.stats() if engine.disk_store is not None else None,
        elastic=engine.elastic.stats() if isinstance(engine.runner, ResizableRunner) else None,
        routes=engine.routes,
        kv_cache_dtype=engine.plan.kv_cache_dtype,
        kv_bytes_per_token=engine.plan.bytes_per_token,
        speculative=engine.speculator.stats() if engine.speculator is not None else None,
    )


def _waste_inputs(engine: LLMEngine) -> tuple[dict[str, Any] | None, int | None]:
    """What the cache's three wastes are measured from (``core.accounting.waste``): the
    live requests' tokens and the next waiting request's length (linear in the live
    tokens; only ``get_stats`` pays for it)."""
    scheduler = engine.scheduler
    requests = scheduler.requests
    tables = engine.kv.live_block_tables()
    token_ids = None
    if all(rid in requests for rid in tables):
        token_ids = {rid: requests[rid].all_token_ids for rid in tables}
    next_len = None
    if scheduler.waiting:
        # Admission order (see Scheduler): priority, then arrival.
        first = min(scheduler.waiting, key=lambda r: (r.priority, r.arrival_time))
        next_len = first.num_prompt_tokens + scheduler.max_tokens(first)
    return token_ids, next_len


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
        "kv_cache_dtype": stats.kv_cache_dtype,
        "bytes_per_token": stats.kv_bytes_per_token,
        "block_size": cache.block_size,
        "blocks_total": cache.blocks_total,
        "blocks_used": cache.blocks_used,
        "blocks_cached_free": cache.blocks_cached_free,
        "blocks_free": cache.blocks_free,
        # Of blocks_used: held only by waiting requests' pins on their cached prefix.
        "blocks_pinned": cache.blocks_pinned,
        "pins_given_up": stats.num_pins_given_up,
        "usage": cache.blocks_used / cache.blocks_total if cache.blocks_total else 0.0,
        "host_blocks_total": cache.host_blocks_total,
        "host_blocks_used": cache.host_blocks_used,
        "waste": {kind: _waste_entry(waste, kind) for kind in _WASTES},
        "headroom_tokens": None if waste is None else waste.headroom_tokens,
        "disk": _disk_entry(stats),
        # Sliding-window models: blocks released because every layer's window passed them.
        "sliding_window": {
            "window": cache.sliding_window,
            "freed_blocks": cache.window_freed_blocks,
        },
        # Models mixing local and global layers: one block table per KV cache group.
        "kv_cache_groups": [
            {
                "sliding_window": group.sliding_window,
                "blocks_used": group.blocks_used,
                "freed_blocks": group.window_freed_blocks,
                "waste": {
                    kind: _waste_entry(group_waste, kind) for kind in ("internal", "duplication")
                },
            }
            for group, group_waste in zip(
                cache.groups, stats.group_waste or (None,) * len(cache.groups), strict=True
            )
        ],
        "elastic": _elastic_entry(stats),
        "prefix_cache": {
            "queries_tokens": queries,
            "hits_tokens": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "inflight_shared_tokens": stats.num_inflight_shared_tokens,
            "inflight_waits": stats.num_inflight_waits,
        },
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        # The scheduler's prompt-token cap for a step that also decodes (None: the budget).
        "max_prefill_tokens_while_decoding": stats.max_prefill_tokens_while_decoding,
        "swapped": stats.num_swapped,
        "preemptions": {
            "recompute": stats.num_preemptions_recompute,
            "swap": stats.num_preemptions_swap,
        },
        # Which implementation runs each capability (None on the fake runner).
        "routes": None if stats.routes is None else stats.routes.as_dict(),
        "speculative": _speculative_entry(stats),
    }


def _speculative_entry(stats: EngineStats) -> dict[str, Any] | None:
    """Speculative decoding's part of the report (None when it is off): totals since
    start-up, and the decode-step cost model the automatic mode decides with."""
    spec = stats.speculative
    if spec is None:
        return None
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "automatic": spec.automatic,
        "verifications": spec.num_verifications,
        "draft_tokens": spec.num_draft_tokens,
        "accepted_tokens": spec.num_accepted_tokens,
        "acceptance_rate": spec.acceptance_rate,
        "mean_acceptance_length": spec.mean_acceptance_length,
        "step_fixed_s": spec.step_fixed_s,
        "step_token_s": spec.step_token_s,
    }


def _elastic_entry(stats: EngineStats) -> dict[str, Any] | None:
    """The elastic pool's part of the report (None for a runner that cannot resize):
    sizes in blocks and bytes, the automatic range, the last resize, recent events."""
    elastic = stats.elastic
    if elastic is None:
        return None
    block = elastic.bytes_per_block
    last = elastic.last_resize
    return {
        "bytes_per_block": block,
        "bytes_total": stats.cache.blocks_total * block,
        "automatic": elastic.min_blocks is not None,
        "min_blocks": elastic.min_blocks,
        "max_blocks": elastic.max_blocks,
        "resizing": elastic.resizing,
        "grows": elastic.num_grows,
        "shrinks": elastic.num_shrinks,
        "last_resize": None if last is None else last.to_dict(),
        "events": [asdict(event) for event in elastic.events],
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
        "stores_set_aside": disk.stores_set_aside,
        "write_errors": disk.write_errors,
        "writes_queued": disk.writes_queued,
    }


_STATUS_ORDER = {RequestStatus.RUNNING: 0, RequestStatus.SWAPPED: 1, RequestStatus.WAITING: 2}


def blocks_report(engine: Any) -> dict[str, Any]:
    """Per-block state and ref count of both tiers plus every live request's tables.

    ``engine`` is an ``LLMEngine``; call this between two steps (``EngineCore``).
    ``state[i]`` is an index into ``state_names`` for block ``i``.
    """
    kv = engine.kv
    tables = kv.live_block_tables()
    host_tables = kv.live_host_block_tables()
    other_groups = kv.live_group_block_tables()[1:]
    requests = sorted(
        engine.scheduler.requests.values(),
        key=lambda r: (_STATUS_ORDER.get(r.status, 3), r.arrival_time, r.request_id),
    )
    rows = [_request_row(r, tables.pop(r.request_id, []), host_tables.pop(r.request_id, []))
            for r in requests]  # fmt: skip
    for row in rows:
        # KV cache groups 1.. (local/global models): their tables beside group 0's.
        row["group_block_tables"] = [group.get(row["request_id"], []) for group in other_groups]
        # A waiting request's pin (its cached prefix, held until admission): in ref_count too.
        row["pinned_blocks"] = kv.pinned_block_ids(row["request_id"])
    # Tables of requests the scheduler no longer lists (should be none): still show them.
    for request_id in sorted(tables.keys() | host_tables.keys()):
        rows.append(
            {
                "request_id": request_id,
                "status": "unknown",
                "block_table": tables.get(request_id, []),
                "host_block_table": host_tables.get(request_id, []),
            }
        )
    return {
        "block_size": kv.block_size,
        "blocks_total": kv.num_blocks,
        "host_blocks_total": kv.num_host_blocks,
        "state_names": list(BLOCK_STATE_NAMES),
        "state": kv.block_states(),
        "ref_count": kv.block_ref_counts(),
        "host_state": kv.block_states(host=True),
        "host_ref_count": kv.block_ref_counts(host=True),
        "requests": rows,
    }


def _request_row(request: Any, table: list[int], host_table: list[int]) -> dict[str, Any]:
    return {
        "request_id": request.request_id,
        "status": request.status.value,
        "block_table": table,
        "host_block_table": host_table,
        "num_tokens": request.num_tokens,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_cached_tokens": request.num_cached_tokens,
        "num_preemptions": request.num_preemptions,
        "priority": request.priority,
    }


def events_report(engine: Any, epoch: str | None, since: int) -> dict[str, Any]:
    """A replica's ``GET /v1/cache/events`` reply (``server/cache_events.py``) for an
    ``LLMEngine``; call it between two steps (``EngineCore``)."""
    kv = engine.kv
    log = kv.events
    batch = log.since(since) if epoch == log.epoch else None
    stats = engine.scheduler.stats()
    body: dict[str, Any] = {
        "epoch": log.epoch,
        "block_size": kv.block_size,
        "next_seq": log.next_seq,
        "kv_usage": kv.usage,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
    }
    if batch is None:
        body["snapshot"] = [h.hex() for h in kv.pool.hashed_blocks().values()]
    else:
        body["first_seq"] = batch.first_seq
        body["events"] = [[kind, h.hex()] for kind, h in batch.events]
    return body
