"""Why is my prompt not cached? The cache advisor behind ``pagedllm cache-report`` and
``GET /v1/cache/advice``.

``analyze(log, tokenizer, block_size=..., num_blocks=...)`` predicts, with the engine's own
hashing and ``KVCacheManager``, the cached tokens of every logged request (unbounded and
with the configured cache), finds where requests that share a head stop sharing it and
what varies there (``divergence``), and prices the log as it is and after the suggested
fix under each provider profile (``prices``). ``build_report`` turns the analysis into
plain data (what ``--json`` prints); ``render_report`` into text.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.planner import divergence as dv
from pagedllm.planner.cache_replay import (
    block_hash_chains,
    replayed_hash_hits,
    replayed_hits,
    unbounded_hash_hits,
    unbounded_hits,
)
from pagedllm.planner.cachelog import CacheLog, LoggedRequest, Tokenizer
from pagedllm.planner.prices import PriceProfile

CONTEXT_TOKENS = 24  # tokens decoded on each side of a differing span
CONTEXT_CHARS = 40  # characters shown on each side in an example
KEY_CHARS = 24  # text before a field that names its place (divergences merge on it)
MAX_GROUPS = 50
GROUP_MIN_SHARED = 64  # tokens shared with an earlier request to join its group
MAX_DIVERGENCES = 50


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where one request stopped sharing a head with an earlier request of its shape."""

    token_index: int  # first token where it differs from the request of its shape
    kind: str
    reference: int  # the earlier request it runs in step with after the field
    shared_after_fix: int  # prefix it would share with the field moved out of the head
    field: str  # the varying text in this request
    other_field: str  # ... and in the reference
    before: str  # text just before the field (also the aggregation key)
    after: str


@dataclass(frozen=True, slots=True)
class RequestAnalysis:
    index: int
    prompt_tokens: int
    cached_unbounded: int
    cached: int | None  # replayed through the configured cache; None: too large for it
    shared: int  # longest token prefix shared with any earlier request
    reference: int | None
    divergence: Divergence | None = None
    reported_cached: int | None = None

    @property
    def shared_after_fix(self) -> int:
        return (
            max(self.shared, self.divergence.shared_after_fix) if self.divergence else self.shared
        )


@dataclass(frozen=True, slots=True)
class Analysis:
    block_size: int
    num_blocks: int | None
    requests: tuple[RequestAnalysis, ...]
    groups: tuple[tuple[int, ...], ...]  # request indices, each group in log order
    group_labels: tuple[str, ...]
    is_hash_trace: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


def analyze(
    log: CacheLog,
    tokenizer: Tokenizer | None,
    *,
    block_size: int,
    num_blocks: int | None,
    min_run: int = dv.DEFAULT_MIN_RUN,
    max_gap: int = dv.DEFAULT_MAX_GAP,
) -> Analysis:
    """Everything the report needs, per request; see the module docstring."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if min_run < 1 or max_gap < 1:
        raise ValueError(f"min_run and max_gap must be >= 1, got {min_run} and {max_gap}")
    if log.is_hash_trace:
        return _analyze_hash_trace(log, num_blocks)
    requests = log.requests
    chains = block_hash_chains(requests, block_size)
    unbounded = unbounded_hits(requests, block_size, chains)
    configured = (
        replayed_hits(requests, block_size, num_blocks) if num_blocks else [None] * len(requests)
    )
    found = _find_divergences(requests, chains, block_size, min_run, max_gap)
    analyses = []
    for r, hit, cached, (shared, ref, resync) in zip(
        requests, unbounded, configured, found, strict=True
    ):
        divergence = None
        if resync is not None and tokenizer is not None:
            divergence = _describe(tokenizer, r, requests[resync.other], resync)
        analyses.append(
            RequestAnalysis(
                r.index,
                len(r.token_ids),
                hit,
                cached,
                shared,
                ref,
                divergence,
                r.reported_cached_tokens,
            )
        )
    groups = _groups(analyses, found, block_size)
    labels = tuple(_label(tokenizer, requests[g[0]].token_ids) for g in groups)
    notes = () if tokenizer is not None else ("no tokenizer: divergences are not described",)
    return Analysis(block_size, num_blocks, tuple(analyses), groups, labels, notes=notes)


def _find_divergences(
    requests: Sequence[LoggedRequest],
    chains: Sequence[Sequence[bytes]],
    block_size: int,
    min_run: int,
    max_gap: int,
) -> list[tuple[int, int | None, dv.Resync | None]]:
    prefix = dv.PrefixIndex(block_size)
    closing = dv.closing_len([r.token_ids for r in requests])
    anchors = dv.AnchorIndex(max_gap)
    found = []
    for r, chain in zip(requests, chains, strict=True):
        tokens, salt = r.token_ids, r.cache_salt
        shared, ref = prefix.observe(r.index, tokens, chain[: len(tokens) // block_size], salt)
        best = None
        if len(tokens) - shared > min_run:
            candidates = [] if ref is None else [ref]
            candidates += [c for c in anchors.candidates(tokens, shared, salt) if c != ref]
            for c in candidates:
                resync = dv.find_resync(
                    tokens,
                    requests[c].token_ids,
                    c,
                    max_gap=max_gap,
                    min_run=min_run,
                    closing=closing,
                )
                if resync is None or resync.start + resync.run < shared + min_run:
                    continue  # no gain over what the request already shares
                if best is None or resync.start + resync.run > best.start + best.run:
                    best = resync
        anchors.add(r.index, tokens, shared, salt)
        found.append((shared, ref, best))
    return found


def _describe(
    tokenizer: Tokenizer,
    request: LoggedRequest,
    other: LoggedRequest,
    resync: dv.Resync,
) -> Divergence:
    tokens, other_tokens = request.token_ids, other.token_ids
    begin = max(0, resync.start - CONTEXT_TOKENS)
    before, differing, after = _decode_split(
        tokenizer, tokens, begin, resync.start, resync.end, resync.end + CONTEXT_TOKENS
    )
    _, other_differing, other_after = _decode_split(
        tokenizer,
        other_tokens,
        begin,
        resync.start,
        resync.other_end,
        resync.other_end + CONTEXT_TOKENS,
    )
    text = dv.field_text(before, differing, other_differing, after, other_after)
    kind, start, end, other_end = dv.classify_span(text)
    return Divergence(
        token_index=resync.start,
        kind=kind,
        reference=resync.other,
        shared_after_fix=resync.start + resync.run,
        field=text.window[start:end],
        other_field=text.other_window[start:other_end],
        before=text.window[:start],
        after=text.window[end:],
    )


def _decode_split(
    tokenizer: Tokenizer, tokens: Sequence[int], begin: int, start: int, end: int, stop: int
) -> tuple[str, str, str]:
    """Text of tokens[begin:start], [start:end], [end:stop], decoded as one piece where the
    tokenizer's decoding is prefix-stable (it is not for a split multi-byte character)."""
    whole = tokenizer.decode(tokens[begin:stop])
    head = tokenizer.decode(tokens[begin:start])
    through = tokenizer.decode(tokens[begin:end])
    if whole.startswith(through) and through.startswith(head):
        return head, through[len(head) :], whole[len(through) :]
    return head, tokenizer.decode(tokens[start:end]), tokenizer.decode(tokens[end:stop])


def _groups(
    analyses: Sequence[RequestAnalysis],
    found: Sequence[tuple[int, int | None, dv.Resync | None]],
    block_size: int,
) -> tuple[tuple[int, ...], ...]:
    """Requests joined with their reference when they share a long head, and with the request of
    their shape past a divergence (union-find); groups in order of their first request."""
    parent = list(range(len(analyses)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # A long head: more than a chat template's opening words.
    long_head = max(GROUP_MIN_SHARED, 2 * block_size)
    for i, (shared, ref, resync) in enumerate(found):
        for other in (ref if shared >= long_head else None, resync.other if resync else None):
            if other is not None:
                parent[max(root(i), root(other))] = min(root(i), root(other))
    members: dict[int, list[int]] = {}
    for i in range(len(analyses)):
        members.setdefault(root(i), []).append(i)
    return tuple(tuple(m) for _, m in sorted(members.items()))


def _label(tokenizer: Tokenizer | None, token_ids: Sequence[int]) -> str:
    if tokenizer is None:
        return "tokens " + " ".join(map(str, token_ids[:8])) + " ..."
    text = tokenizer.decode(token_ids[:32]).replace("\n", "\\n")
    return text[:60] + ("..." if len(text) > 60 else "")


def _hash_label(hash_ids: Sequence[int]) -> str:
    shown = ", ".join(map(str, hash_ids[:4]))
    return f"hash ids {shown}" + (", ..." if len(hash_ids) > 4 else "")


def _analyze_hash_trace(log: CacheLog, num_blocks: int | None) -> Analysis:
    requests = log.hash_requests
    unbounded = unbounded_hash_hits(requests)
    configured = replayed_hash_hits(requests, num_blocks) if num_blocks else [None] * len(requests)
    analyses = tuple(
        RequestAnalysis(r.index, r.input_length, hit, cached, hit, None)
        for r, hit, cached in zip(requests, unbounded, configured, strict=True)
    )
    by_head: dict[int | None, list[int]] = {}
    for r in requests:
        by_head.setdefault(r.hash_ids[0] if r.hash_ids else None, []).append(r.index)
    groups = tuple(tuple(m) for m in by_head.values())
    labels = tuple(_hash_label(requests[g[0]].hash_ids) for g in groups)
    notes = (
        "block-hash trace: 512-token blocks; no text, so no divergence kinds; provider "
        "costs count the shared prefix in whole 512-token blocks",
    )
    return Analysis(512, num_blocks, analyses, groups, labels, is_hash_trace=True, notes=notes)


# ---- the report ---------------------------------------------------------------------


def build_report(
    analysis: Analysis,
    profiles: Mapping[str, PriceProfile],
    *,
    source: str = "",
    model: str = "",
) -> dict[str, Any]:
    """The report as plain data (``--json``): totals, groups, divergences, costs."""
    requests = analysis.requests
    prompt = sum(r.prompt_tokens for r in requests)
    replayed = analysis.num_blocks is not None
    cached = sum((r.cached or 0) if replayed else r.cached_unbounded for r in requests)
    unbounded = sum(r.cached_unbounded for r in requests)
    report: dict[str, Any] = {
        "source": source,
        "model": model,
        "format": "hash_ids" if analysis.is_hash_trace else "tokens",
        "block_size": analysis.block_size,
        "num_blocks": analysis.num_blocks,
        "requests": len(requests),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": _rate(cached, prompt),
        "recomputed_tokens": prompt - cached,
        "cache": "configured" if replayed else "unbounded",
        "unbounded": {
            "cached_tokens": unbounded,
            "hit_rate": _rate(unbounded, prompt),
            "recomputed_tokens": prompt - unbounded,
        },
        "refused_requests": sum(1 for r in requests if replayed and r.cached is None),
        "groups": _group_rows(analysis, replayed),
        "divergences": divergence_rows(analysis),
        "cost": cost_rows(analysis, profiles),
        "hit_rate_by_position": hit_rate_by_position(analysis, replayed),
        "notes": list(analysis.notes),
    }
    if any(r.reported_cached is not None for r in requests):
        report["reported"] = _agreement(requests, replayed)
    return report


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _cached(r: RequestAnalysis, replayed: bool) -> int:
    return (r.cached or 0) if replayed else r.cached_unbounded


def _group_rows(analysis: Analysis, replayed: bool) -> list[dict[str, Any]]:
    rows = []
    for members, label in zip(analysis.groups, analysis.group_labels, strict=True):
        prompt = sum(analysis.requests[i].prompt_tokens for i in members)
        cached = sum(_cached(analysis.requests[i], replayed) for i in members)
        rows.append(
            {
                "label": label,
                "requests": len(members),
                "first_request": members[0],
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": _rate(cached, prompt),
                "recomputed_tokens": prompt - cached,
            }
        )
    rows.sort(key=lambda row: -row["recomputed_tokens"])
    return rows[:MAX_GROUPS]


def engine_gain(r: RequestAnalysis, block_size: int) -> int:
    """Prompt tokens the engine would also find cached (unbounded) after the fix."""
    if r.divergence is None:
        return 0
    limit = (r.prompt_tokens - 1) // block_size * block_size
    after = min(r.divergence.shared_after_fix // block_size * block_size, limit)
    return max(0, after - r.cached_unbounded)


def divergence_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """Divergences aggregated by kind and the text before the field, largest loss first."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for r in analysis.requests:
        d = r.divergence
        if d is None:
            continue
        key = (d.kind, d.before[-KEY_CHARS:])
        row = merged.get(key)
        gain = engine_gain(r, analysis.block_size)
        if row is None:
            row = merged[key] = {
                "kind": d.kind,
                "token_index": d.token_index,
                "requests": 0,
                "tokens_recomputed": 0,
                "example": _example(d),
                "varies_from": d.other_field,
                "suggestion": dv.SUGGESTIONS[d.kind],
                "request_indices": [],
            }
        row["token_index"] = min(row["token_index"], d.token_index)
        row["requests"] += 1
        row["tokens_recomputed"] += gain
        if len(row["request_indices"]) < 20:
            row["request_indices"].append(r.index)
    rows = sorted(merged.values(), key=lambda row: (-row["tokens_recomputed"], row["token_index"]))
    return rows[:MAX_DIVERGENCES]


def _example(d: Divergence) -> str:
    before = d.before[-CONTEXT_CHARS:].replace("\n", "\\n")
    after = d.after[:CONTEXT_CHARS].replace("\n", "\\n")
    return f"...{before}[{d.field}]{after}..."


def cost_rows(analysis: Analysis, profiles: Mapping[str, PriceProfile]) -> dict[str, Any]:
    """Input cost per profile as the log is and after the suggested fix."""
    out = {}
    for name, profile in profiles.items():
        as_is = after = 0.0
        for r in analysis.requests:
            as_is += profile.request_cost(r.prompt_tokens, r.shared).cost
            after += profile.request_cost(r.prompt_tokens, r.shared_after_fix).cost
        out[name] = {
            "as_is": round(as_is, 6),
            "after_fix": round(after, 6),
            "saving": round(as_is - after, 6),
            "currency": profile.currency,
            "as_of": profile.as_of,
            "provider": profile.provider,
            "model": profile.model,
        }
    return out


def hit_rate_by_position(analysis: Analysis, replayed: bool, points: int = 48) -> list[list[float]]:
    """[position, share of the requests reaching that position that found it cached]."""
    cached = sorted(_cached(r, replayed) for r in analysis.requests)
    lengths = sorted(r.prompt_tokens for r in analysis.requests)
    if not lengths:
        return []
    longest = lengths[-1]
    out = []
    for k in range(points):
        position = int(longest * k / points)
        reaching = len(lengths) - bisect.bisect_right(lengths, position)
        hit = len(cached) - bisect.bisect_right(cached, position)
        out.append([position, _rate(hit, reaching)])
    return out


def _agreement(requests: Sequence[RequestAnalysis], replayed: bool) -> dict[str, Any]:
    pairs = [
        (r.reported_cached, _cached(r, replayed)) for r in requests if r.reported_cached is not None
    ]
    reported = sum(a for a, _ in pairs)
    predicted = sum(b for _, b in pairs)
    exact = sum(1 for a, b in pairs if a == b)
    return {
        "requests": len(pairs),
        "exact": exact,
        "exact_fraction": _rate(exact, len(pairs)),
        "reported_cached_tokens": reported,
        "predicted_cached_tokens": predicted,
        "total_error_fraction": abs(predicted - reported) / reported if reported else 0.0,
    }


def render_report(report: Mapping[str, Any], *, top: int = 10) -> str:
    """The report as text."""
    lines = [
        f"pagedllm cache-report: {report['source']} ({report['requests']:,} requests, "
        f"model {report['model']}, block size {report['block_size']})",
        _totals_line(report["cache"], report, report["num_blocks"]),
        _totals_line(
            "unbounded", report["unbounded"] | {"prompt_tokens": report["prompt_tokens"]}, None
        ),
    ]
    if report["refused_requests"]:
        lines.append(f"  {report['refused_requests']} requests larger than the whole cache")
    if "reported" in report:
        a = report["reported"]
        lines.append(
            f"  vs the server's report: {a['exact']:,} of {a['requests']:,} requests exact "
            f"({a['exact_fraction']:.1%}); {a['predicted_cached_tokens']:,} predicted vs "
            f"{a['reported_cached_tokens']:,} reported cached tokens ({a['total_error_fraction']:.2%} off)"
        )
    lines += ["", "request groups (largest loss first):"]
    lines.append(f"  {'requests':>8} {'prompt tok':>11} {'hit rate':>8} {'recomputed':>11}  head")
    for g in report["groups"][:top]:
        lines.append(
            f"  {g['requests']:>8,} {g['prompt_tokens']:>11,} {g['hit_rate']:>8.1%} "
            f"{g['recomputed_tokens']:>11,}  {g['label']}"
        )
    lines += ["", "divergence points (largest loss first):"]
    if report["format"] == "hash_ids":
        lines.append("  none: a block-hash trace has no tokens to compare or text to read")
    elif not report["divergences"]:
        lines.append("  none found: requests that share a head keep sharing it")
    for d in report["divergences"][:top]:
        lines.append(
            f"  token {d['token_index']:,}, {d['kind']}, {d['requests']:,} requests, "
            f"{d['tokens_recomputed']:,} tokens recomputed because of it"
        )
        lines.append(f"    {d['example']}  (elsewhere: {d['varies_from']!r})")
        lines.append(f"    fix: {d['suggestion']}")
    lines += ["", "input cost per provider profile (as is -> after the fix):"]
    for name, c in report["cost"].items():
        lines.append(
            f"  {name:<28} {c['as_is']:>12.4f} -> {c['after_fix']:>12.4f} {c['currency']} "
            f"(saves {c['saving']:.4f}; prices of {c['as_of']})"
        )
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def _totals_line(name: str, figures: Mapping[str, Any], num_blocks: int | None) -> str:
    where = f"{name} cache" + (f" ({num_blocks:,} blocks)" if num_blocks else "")
    return (
        f"  {where:<28} {figures['cached_tokens']:,} of {figures['prompt_tokens']:,} prompt tokens "
        f"cached ({figures['hit_rate']:.1%}), {figures['recomputed_tokens']:,} recomputed"
    )
