"""Data-parallel replicas behind a router, simulated: the real scheduler and block manager
per replica, the real routing policies (``core/routing.py``), fabricated tokens.

Each replica steps on its own clock (``CostModel``); a request is routed at its arrival
time. The router's picture of a replica's cache is fed by that replica's cache events as
they stood ``event_delay_s`` earlier (a router polls); ``oracle`` routes with the same rule
on every replica's true cache at that instant. What comes out is measured: prefix hit
rate (cached / prompt tokens, as the engines count them at admission), time to first
token, throughput, and the requests each replica served.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.core.hashing import hash_request_blocks
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.core.routing import (
    ROUTING_POLICIES,
    ReplicaCacheView,
    ReplicaState,
    make_policy,
    predicted_cached_tokens,
)
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.planner.simulate import CostModel
from pagedllm.sampling_params import SamplingParams

SIM_POLICIES = (*ROUTING_POLICIES, "oracle")
MOONCAKE_BLOCK_TOKENS = 512  # tokens behind one hash id of a Mooncake trace


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a routed workload: its token ids matter to the prefix caches."""

    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class RouterSimConfig:
    num_replicas: int
    policy: str
    num_blocks: int  # per replica
    block_size: int = 16
    max_model_len: int = 32768
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cost: CostModel = field(default_factory=CostModel)
    event_delay_s: float = 0.05
    max_imbalance: int = 8


@dataclass(frozen=True, slots=True)
class RouterSimResult:
    policy: str
    num_replicas: int
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    predicted_cached_tokens: int  # the router's prediction from its event-fed view
    hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    duration_s: float
    output_tokens_per_s: float
    requests_per_replica: tuple[int, ...]


class _Replica:
    """One simulated engine (internal, mutable)."""

    def __init__(self, config: RouterSimConfig) -> None:
        self.kv = KVCacheManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
            ),
            self.kv,
        )
        self.clock = 0.0
        self.load = 0
        self.view = ReplicaCacheView()
        self.view.reset(self.kv.events.epoch, 0, ())
        self.marks: list[tuple[float, int]] = [(0.0, 0)]  # (time, events logged by then)

    def step(self, cost: CostModel, first_token: dict[str, float]) -> list[Request]:
        output = self.scheduler.schedule()
        if output.is_empty:
            raise ValueError("a replica with unfinished requests scheduled nothing")
        self.clock += cost.step_seconds(output.num_batched_tokens)
        finished = []
        for update in self.scheduler.update(output, _fabricate(output)):
            request = update.request
            if request.num_output_tokens and request.request_id not in first_token:
                first_token[request.request_id] = self.clock
            if request.is_finished:
                finished.append(request)
                self.load -= 1
        self.marks.append((self.clock, self.kv.events.next_seq))
        return finished

    def sync_view(self, now: float) -> None:
        """Apply the events logged up to ``now`` (the router's view lags by the delay)."""
        seq = self.view.next_seq
        for time, mark in self.marks:
            if time <= now:
                seq = max(seq, mark)
        if seq <= self.view.next_seq:
            return
        batch = self.kv.events.since(self.view.next_seq)
        if batch is None:  # fell behind the log: start from what the index holds now
            log = self.kv.events
            self.view.reset(log.epoch, log.next_seq, self.kv.pool.hashed_blocks().values())
            return
        events = batch.events[: seq - batch.first_seq]
        self.view.apply(type(batch)(batch.epoch, batch.first_seq, seq, events))
        self.marks = [(t, m) for t, m in self.marks if m > seq] or [(now, seq)]

    def true_matched_blocks(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> int:
        bs = self.kv.block_size
        count = 0
        for i, block_hash in enumerate(hashes):
            if self.kv.pool.lookup(block_hash, tokens[i * bs : (i + 1) * bs]) is None:
                break
            count += 1
        return count


def simulate_router(requests: Sequence[SimRequest], config: RouterSimConfig) -> RouterSimResult:
    """Route ``requests`` (sorted by arrival) over ``num_replicas`` simulated engines."""
    if config.policy not in SIM_POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; choose from {', '.join(SIM_POLICIES)}")
    if config.num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {config.num_replicas}")
    if not requests:
        raise ValueError("nothing to simulate: no requests")
    policy = make_policy(
        "prefix_aware" if config.policy == "oracle" else config.policy,
        max_imbalance=config.max_imbalance,
    )
    replicas = [_Replica(config) for _ in range(config.num_replicas)]
    arrivals = sorted(enumerate(requests), key=lambda item: item[1].arrival_time)
    first_token: dict[str, float] = {}
    arrival_of: dict[str, float] = {}
    served = [0] * config.num_replicas
    prompt_tokens = cached_tokens = predicted = output_tokens = 0
    next_arrival = 0
    while next_arrival < len(arrivals) or any(
        r.scheduler.has_unfinished_requests() for r in replicas
    ):
        busy = [r for r in replicas if r.scheduler.has_unfinished_requests()]
        step_at = min((r.clock for r in busy), default=float("inf"))
        if next_arrival < len(arrivals) and arrivals[next_arrival][1].arrival_time <= step_at:
            index, item = arrivals[next_arrival]
            next_arrival += 1
            request = _request(index, item)
            now = item.arrival_time
            hashes = hash_request_blocks(
                request.prompt_token_ids, config.block_size, request.extra_keys
            )
            choice, guess = _route(policy, config, replicas, request, hashes, now)
            replica = replicas[choice]
            replica.view.add_pending(hashes, now)
            replica.clock = max(replica.clock, now)
            replica.load += 1
            replica.scheduler.add_request(request)
            served[choice] += 1
            arrival_of[request.request_id] = now
            predicted += predicted_cached_tokens(guess, config.block_size, request.num_tokens)
            continue
        replica = min(busy, key=lambda r: r.clock)
        for request in replica.step(config.cost, first_token):
            prompt_tokens += request.num_prompt_tokens
            cached_tokens += request.num_cached_tokens
            output_tokens += request.num_output_tokens
    ttfts = sorted(first_token[rid] - arrival_of[rid] for rid in arrival_of)
    duration = max(r.clock for r in replicas)
    return RouterSimResult(
        policy=config.policy,
        num_replicas=config.num_replicas,
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        predicted_cached_tokens=predicted,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_mean_s=sum(ttfts) / len(ttfts),
        ttft_p50_s=ttfts[len(ttfts) // 2],
        ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        duration_s=duration,
        output_tokens_per_s=output_tokens / duration if duration else 0.0,
        requests_per_replica=tuple(served),
    )


def _route(
    policy,
    config: RouterSimConfig,
    replicas: list[_Replica],
    request: Request,
    hashes: list[bytes],
    now: float,
) -> tuple[int, int]:
    """(replica index, matched blocks the router's view predicted there)."""
    states, predicted = [], []
    for replica in replicas:
        replica.sync_view(now - config.event_delay_s)
        matched = replica.view.matched_blocks(hashes, with_pending=True)
        predicted.append(matched)
        if config.policy == "oracle":  # routes on the truth (and what is in flight)
            truth = replica.true_matched_blocks(hashes, request.prompt_token_ids)
            matched = max(matched, truth)
        states.append(ReplicaState(True, replica.load, replica.kv.usage, matched))
    choice = policy.choose(states)
    return choice, predicted[choice]


def _request(index: int, item: SimRequest) -> Request:
    params = SamplingParams(max_tokens=max(1, item.output_len), ignore_eos=True)
    return Request(
        f"r{index}",
        list(item.prompt_token_ids),
        sampling_params=params,
        arrival_time=item.arrival_time,
        cache_salt=item.cache_salt,
    )


def _fabricate(output: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids=tuple((7,) * s.num_samples for s in output.scheduled)
    )


def hash_block_tokens_for(hash_id: int, num_tokens: int) -> list[int]:
    """The stand-in token ids of one trace block: fixed by its id, so requests sharing
    the id share the tokens (and therefore the engine's hashes)."""
    rng = random.Random(hash_id)
    return [rng.randrange(1000, 50000) for _ in range(num_tokens)]


def read_routed_trace(
    path: str | Path,
    *,
    tokens_per_hash: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[SimRequest]:
    """A JSONL trace as routed requests. Each line has ``timestamp`` (ms) and either
    ``prompt_token_ids`` or Mooncake's ``hash_ids`` (one id per 512-token block, chained)
    with ``input_length``; ``output_length`` (or ``output_tokens``); optional
    ``cache_salt``. Hash ids become ``tokens_per_hash`` stand-in tokens each (lengths
    scale by ``tokens_per_hash / 512``); ``time_scale`` stretches arrival times."""
    requests = []
    scale = tokens_per_hash / MOONCAKE_BLOCK_TOKENS
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            tokens = _trace_tokens(row, tokens_per_hash, scale)
            output = int(row.get("output_length", row.get("output_tokens", 1)))
            arrival = float(row.get("timestamp", 0)) / 1000 * time_scale
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace {path}:{number}: {exc}") from None
        if not tokens:
            raise ValueError(f"trace {path}:{number}: empty prompt")
        salt = row.get("cache_salt")
        requests.append(SimRequest(arrival, tuple(tokens), max(1, output), salt))
    if not requests:
        raise ValueError(f"trace {path}: no requests")
    return requests


def _trace_tokens(row: dict, tokens_per_hash: int, scale: float) -> list[int]:
    if "prompt_token_ids" in row:
        return [int(t) for t in row["prompt_token_ids"]]
    tokens: list[int] = []
    for hash_id in row["hash_ids"]:
        tokens += hash_block_tokens_for(int(hash_id), tokens_per_hash)
    length = max(1, round(int(row["input_length"]) * scale))
    return tokens[:length]


def shared_prefix_workload(
    num_tenants: int,
    requests_per_tenant: int,
    prefix_tokens: int,
    suffix_tokens: int,
    output_len: int,
    *,
    arrival_rate: float = float("inf"),
    seed: int = 0,
) -> list[SimRequest]:
    """Multi-tenant shared-prefix requests (each tenant's system prompt, then a private
    question), interleaved across tenants, Poisson arrivals (``inf``: all at time 0)."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1000, 30000) for _ in range(prefix_tokens)] for _ in range(num_tenants)
    ]
    order = [t for _ in range(requests_per_tenant) for t in range(num_tenants)]
    rng.shuffle(order)
    clock, out = 0.0, []
    for tenant in order:
        if arrival_rate != float("inf"):
            clock += rng.expovariate(arrival_rate)
        suffix = [rng.randrange(1000, 30000) for _ in range(suffix_tokens)]
        out.append(SimRequest(clock, tuple(prefixes[tenant] + suffix), output_len))
    return out
