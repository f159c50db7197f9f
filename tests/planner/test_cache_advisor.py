"""The cache advisor: exact hits by hand, the corpora with planted fields, money by hand."""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import pytest

from pagedllm.core.hashing import hash_request_blocks
from pagedllm.model.tokenizer import HFTokenizer
from pagedllm.planner import divergence as dv
from pagedllm.planner.cache_advisor import analyze, build_report, cost_rows, render_report
from pagedllm.planner.cache_replay import (
    replayed_hash_hits,
    replayed_hits,
    unbounded_hash_hits,
    unbounded_hits,
)
from pagedllm.planner.cachelog import LoggedRequest, parse_records, read_log
from pagedllm.planner.prices import PriceProfile, load_profiles, profile_from_dict

from .cache_corpus import make_corpus, messages

DATA = Path(__file__).parent / "data"


def req(i: int, tokens: list[int], salt: str | None = None, out: tuple = ()) -> LoggedRequest:
    return LoggedRequest(i, tuple(tokens), cache_salt=salt, output_token_ids=tuple(out))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    pytest.importorskip("transformers")
    from pagedllm.testing import make_tiny_tokenizer

    return HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


# ---- hits by hand ---------------------------------------------------------------------


def test_unbounded_hits_by_hand():
    a = list(range(10))  # blocks of 4: [0..3] [4..7], 2 tokens left over
    log = [
        req(0, a),
        req(1, a),  # 2 full blocks, both cached (cap: (10 - 1) // 4 = 2 blocks)
        req(2, a[:8]),  # capped at 7 tokens: 1 block
        req(3, a[:4] + [99] * 6),  # first block only
        req(4, a, salt="tenant"),  # another tenant's salt: nothing
        req(5, a, salt="tenant"),
        req(6, [7, 7, 7, 7, 8], out=(1, 2, 3, 4)),  # computes 5 + 3 tokens: 2 blocks cached
        req(7, [7, 7, 7, 7, 8, 1, 2, 3, 5, 5]),
    ]
    assert unbounded_hits(log, 4) == [0, 8, 4, 4, 0, 8, 0, 8]
    assert replayed_hits(log, 4, 100) == [0, 8, 4, 4, 0, 8, 0, 8]


def test_replay_evicts_least_recently_used_tail_first():
    # 4 blocks of 2 tokens; each request takes 3 (2 full, cached when freed, 1 partial).
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    log = [req(0, a), req(1, b), req(2, a), req(3, b)]
    # B: 2 plain free blocks, then evicts the least recently released cached block, A's
    # tail [3, 4] (a finished request frees tail first). A again: finds [1, 2] only, and
    # evicts B's tail; B again finds [6, 7] only.
    assert replayed_hits(log, 2, 4) == [0, 0, 2, 2]
    assert replayed_hits(log, 2, 6) == [0, 0, 4, 4] == unbounded_hits(log, 2)
    assert replayed_hits([req(0, list(range(20)))], 2, 4) == [None]  # larger than the cache


def test_unbounded_hits_use_the_engine_hash_chain():
    tokens = list(range(40))
    hashes = hash_request_blocks(tokens, 8, ("s",))
    assert len(hashes) == 5 and hashes != hash_request_blocks(tokens, 8)
    assert unbounded_hits([req(0, tokens, "s"), req(1, tokens[:33], "s")], 8) == [0, 32]


def test_hash_trace_rules_by_hand():
    log = parse_records(
        [
            (1, {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]}),
            (2, {"timestamp": 1, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}),
            (
                3,
                {
                    "timestamp": 2,
                    "input_length": 2000,
                    "output_length": 5,
                    "hash_ids": [1, 2, 4, 5],
                },
            ),
            (4, {"timestamp": 3, "input_length": 600, "output_length": 5, "hash_ids": [9, 2]}),
        ]
    )
    # Unbounded: longest prefix of ids seen, x 512, capped at input_length.
    assert unbounded_hash_hits(log.hash_requests) == [0, 1100, 1024, 0]
    assert replayed_hash_hits(log.hash_requests, 100) == [0, 1100, 1024, 0]
    # A request needs a block per id: with 3 blocks the 4-id request cannot be held.
    assert replayed_hash_hits(log.hash_requests, 2) == [None, None, None, 0]
    assert replayed_hash_hits(log.hash_requests, 3) == [0, 1100, None, 0]
    assert replayed_hash_hits(log.hash_requests, 4) == [0, 1100, 1024, 0]


def test_mooncake_fixture_unbounded_equals_a_large_replay():
    log = read_log(DATA / "mooncake_head400.jsonl")
    assert log.is_hash_trace and len(log) == 400
    unbounded = unbounded_hash_hits(log.hash_requests)
    total_blocks = sum(len(r.hash_ids) for r in log.hash_requests)
    assert replayed_hash_hits(log.hash_requests, total_blocks) == unbounded
    assert sum(unbounded) > 0  # the trace's multi-turn sessions share prefixes
    small = replayed_hash_hits(log.hash_requests, 200)
    assert all(s is None or s <= u for s, u in zip(small, unbounded, strict=True))
    assert sum(s or 0 for s in small) < sum(unbounded)
    report = build_report(analyze(log, None, block_size=512, num_blocks=200), load_profiles())
    assert report["format"] == "hash_ids" and report["requests"] == 400
    assert report["unbounded"]["cached_tokens"] == sum(unbounded)


# ---- the prefix index against a plain reference ---------------------------------------


def plain_shared(token_lists: list[tuple[int, ...]]) -> list[int]:
    """Longest prefix shared with any earlier list: the neighbours in sorted order."""
    seen: list[tuple[int, ...]] = []
    out = []
    for tokens in token_lists:
        k = bisect.bisect_left(seen, tokens)
        best = 0
        for other in seen[max(0, k - 1) : k + 1]:
            n = 0
            while n < min(len(tokens), len(other)) and tokens[n] == other[n]:
                n += 1
            best = max(best, n)
        out.append(best)
        bisect.insort(seen, tokens)
    return out


def test_prefix_index_matches_the_plain_reference():
    import random

    rng = random.Random(3)
    heads = [tuple(rng.randrange(50) for _ in range(rng.randrange(0, 70))) for _ in range(12)]
    lists = []
    for _ in range(600):
        head = rng.choice(heads)
        cut = rng.randrange(len(head) + 1)
        lists.append(head[:cut] + tuple(rng.randrange(50) for _ in range(rng.randrange(1, 40))))
    for block_size in (1, 4, 16):
        index = dv.PrefixIndex(block_size)
        got = [
            index.observe(i, t, hash_request_blocks(t, block_size), None)[0]
            for i, t in enumerate(lists)
        ]
        assert got == plain_shared(lists), block_size


# ---- planted fields -------------------------------------------------------------------

PREFIX = "<|im_start|>system\n"


def field_token_span(tokenizer: HFTokenizer, p) -> tuple[int, int]:
    """Tokens of the rendered prompt that overlap the planted value (offsets mapping)."""
    text = tokenizer.render_chat(messages(p))
    offsets = tokenizer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    # From the space before the value: a BPE tokenizer may merge it into the value's first
    # token, or split it off when the other value starts differently (" 5" vs " db").
    begin = len(PREFIX) + p.start - 1
    end = begin + 1 + len(p.value)
    first = next(i for i, (_, e) in enumerate(offsets) if e > begin)
    last = next((i for i, (b, _) in enumerate(offsets) if b >= end), len(offsets))
    return first, last


@pytest.fixture(params=["bytes", "smollm2"])
def corpus_tokenizer(request, tokenizer) -> HFTokenizer:
    """The byte-level test tokenizer, and the default model's BPE where it is on disk."""
    if request.param == "bytes":
        return tokenizer
    from pagedllm.model.default_model import MODEL_DIR_NAME, cache_dir

    path = cache_dir() / MODEL_DIR_NAME
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"the default model's tokenizer is not in {path}")
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))


def test_planted_fields_found_classified_and_never_in_identical_heads(corpus_tokenizer):
    tokenizer = corpus_tokenizer
    corpus = make_corpus(1000, seed=7)
    log = parse_records(
        [(i + 1, {"messages": messages(p)}) for i, p in enumerate(corpus)], tokenizer
    )
    assert tokenizer.decode(log.requests[0].token_ids).startswith(PREFIX)
    analysis = analyze(log, tokenizer, block_size=16, num_blocks=4096)
    truth = plain_shared([r.token_ids for r in log.requests])
    # The first divergent token of every request, exactly.
    assert [r.shared for r in analysis.requests] == truth
    should, found, correct, flagged = 0, 0, 0, 0
    seen_templates: set[int] = set()
    for p, r in zip(corpus, analysis.requests, strict=True):
        start, end = field_token_span(tokenizer, p)
        in_field = p.kind is not None and start <= r.shared <= end
        if in_field and p.template in seen_templates:
            should += 1
            found += r.divergence is not None and r.divergence.kind == p.kind
        if r.divergence is not None:
            # Where it parts from the earlier request of its own shape: at most where it
            # parts from every earlier request (the same place, unless another shape
            # happened to share more, e.g. the same name).
            flagged += 1
            d = r.divergence
            assert d.token_index <= r.shared
            tokens, other = log.requests[r.index].token_ids, log.requests[d.reference].token_ids
            assert tokens[: d.token_index] == other[: d.token_index]
            assert tokens[d.token_index] != other[d.token_index]
            correct += p.kind is not None and start <= d.token_index <= end and d.kind == p.kind
            if p.kind is None:
                pytest.fail(f"request {r.index}: identical head flagged: {r.divergence}")
        seen_templates.add(p.template)
    assert should > 500
    assert found / should >= 0.90, (found, should)
    assert correct / flagged >= 0.95, (correct, flagged)
    report = build_report(analysis, load_profiles())
    kinds = {d["kind"] for d in report["divergences"]}
    assert kinds == set(dv.KINDS)
    losses = [d["tokens_recomputed"] for d in report["divergences"]]
    assert losses == sorted(losses, reverse=True) and losses[0] > 0
    assert "divergence points" in render_report(report)


@pytest.mark.parametrize(
    ("mine", "theirs", "kind"),
    [
        ("2025-03-04 10:22:01", "2025-03-04 11:02:59", "timestamp"),
        ("2025-03-04T10:22:01Z", "2025-04-04T10:22:01Z", "timestamp"),
        ("1733011200", "1733097600", "timestamp"),
        ("March 4, 2025", "March 12, 2025", "date"),
        ("2025-03-04", "2025-03-05", "date"),
        ("3f2b8c1e-0a4d-4e8b-9c1f-2d3e4f5a6b7c", "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d", "uuid"),
        ("9f86d081884c7d65", "1b4f0e9851971998", "hex_id"),
        ("12,345", "678", "number"),
        ("Alice Johnson", "Bob Smith", "name"),
        ("likes hiking by the lake", "prefers short answers", "text"),
    ],
)
def test_classify_from_text(mine, theirs, kind):
    before, after = "Session data: ", ". You are a helpful agent."
    field = dv.field_text(before, mine, theirs, after, after)
    assert dv.classify(field) == kind


def test_resync_needs_a_long_common_run():
    a = list(range(100))
    b = a[:10] + [500, 501] + a[12:]
    r = dv.find_resync(a, b, 1, min_run=32)
    assert (r.start, r.end, r.other_end, r.run) == (10, 12, 12, 88)
    assert dv.find_resync(a, a[:10] + [7] * 90, 1, min_run=32) is None


# ---- money ----------------------------------------------------------------------------

PROFILE = {
    "name": "hand",
    "provider": "test",
    "model": "m",
    "as_of": "2026-01-01",
    "input_per_mtok": 2.0,
    "cached_input_per_mtok": 0.5,
    "cache_write_per_mtok": 2.5,
    "min_cacheable_tokens": 64,
    "cache_increment_tokens": 16,
}


def test_money_matches_a_hand_calculation(tmp_path):
    head = list(range(1000, 1100))  # 100 shared tokens
    prompts = [
        head + [1] * 50,  # 150 tokens, shares nothing
        head + [2] * 50,  # shares 100
        head + [1] * 50,  # shares 150 (identical to 0)
        head[:70] + [3] * 10,  # 80, shares 70
        [5] * 40,  # 40, below the minimum
        [5] * 40 + [6] * 60,  # 100, shares 40
        head + [2] * 50 + [9] * 30,  # 180, shares 150
        head[:63] + [4],  # 64, shares 63
        head[:64] + [4] * 36,  # 100, shares 64
        head + [1] * 50 + [8] * 200,  # 350, shares 150
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"profiles": [PROFILE]}))
    profile = load_profiles(prices)["hand"]
    # cacheable(n): 0 below 64, else 64 + 16k. Per request (shared, prompt):
    # cached = cacheable(shared), written = cacheable(prompt) - cached, fresh = the rest.
    rows = [  # (fresh, cached, written)
        (150 - 144, 0, 144),
        (150 - 144, 96, 144 - 96),
        (150 - 144, 144, 0),
        (80 - 80, 64, 80 - 64),
        (40, 0, 0),
        (100 - 96, 0, 96),
        (180 - 176, 144, 176 - 144),
        (0, 0, 64),
        (100 - 96, 64, 96 - 64),
        (350 - 336, 144, 336 - 144),
    ]
    hand = sum(f * 2.0 + c * 0.5 + w * 2.5 for f, c, w in rows) / 1e6
    log = read_log(path)
    analysis = analyze(log, None, block_size=16, num_blocks=None)
    assert [r.shared for r in analysis.requests] == [0, 100, 150, 70, 0, 40, 150, 63, 64, 150]
    got = cost_rows(analysis, {"hand": profile})["hand"]
    assert got["as_is"] == pytest.approx(hand, abs=1e-4)
    assert got["as_is"] == pytest.approx(hand, abs=1e-9)
    assert got["after_fix"] == got["as_is"]  # nothing to fix here
    assert got["currency"] == "USD" and got["as_of"] == "2026-01-01"


def test_price_profiles_validate_and_override(tmp_path):
    override = profile_from_dict(
        {"name": "openai-gpt-4.1", "cached_input_per_mtok": 0.25}, base=load_profiles()
    )
    assert override.cached_input_per_mtok == 0.25 and override.input_per_mtok == 2.0
    with pytest.raises(ValueError, match="unknown fields"):
        profile_from_dict({"name": "x", "price": 1})
    with pytest.raises(ValueError, match="missing"):
        profile_from_dict({"name": "new", "input_per_mtok": 1})
    with pytest.raises(ValueError, match=">= 0"):
        PriceProfile("x", "p", "m", "2026-01-01", -1, 0, 0, 0)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="price file"):
        load_profiles(bad)


def test_log_errors_name_the_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [1, -2]}\n')
    with pytest.raises(ValueError, match=":2: prompt_token_ids"):
        read_log(path)
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="tokenizer"):
        read_log(path)
    path.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match=":1: needs one of"):
        read_log(path)
    path.write_text("[1]\n")
    with pytest.raises(ValueError, match="JSON object"):
        read_log(path)


# ---- the command ----------------------------------------------------------------------


def test_cache_report_command_json_and_plot(tmp_path, tokenizer, capsys):
    from pagedllm.cli import main

    model_dir = tmp_path / "tok"
    tokenizer.tokenizer.save_pretrained(model_dir)
    corpus = make_corpus(120, seed=2, num_templates=4)
    log = tmp_path / "log.jsonl"
    lines = [{"messages": messages(p), "timestamp": i} for i, p in enumerate(corpus)]
    lines[1] = {"prompt": corpus[1].system, "cache_salt": "t1"}
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot = tmp_path / "plot.png"
    argv = ["cache-report", str(log), "--model", str(model_dir), "--num-blocks", "512"]
    assert main([*argv, "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("requests", "prompt_tokens", "cached_tokens", "hit_rate", "recomputed_tokens"):
        assert key in report
    assert report["requests"] == 120 and report["num_blocks"] == 512
    assert report["recomputed_tokens"] == report["prompt_tokens"] - report["cached_tokens"]
    assert report["divergences"], "the corpus plants fields"
    for d in report["divergences"]:
        assert {
            "kind",
            "token_index",
            "requests",
            "tokens_recomputed",
            "example",
            "suggestion",
        } <= set(d)
        assert d["kind"] in dv.KINDS
    for cost in report["cost"].values():
        assert {"as_is", "after_fix", "currency"} <= set(cost) and cost["after_fix"] <= cost[
            "as_is"
        ]
    assert plot.stat().st_size > 10_000
    assert main([*argv, "--profile", "deepseek-chat"]) == 0
    text = capsys.readouterr().out
    assert "divergence points" in text and "deepseek-chat" in text and "openai" not in text
    assert main(["cache-report", str(tmp_path / "missing.jsonl"), "--num-blocks", "8"]) == 2
    assert "no such file" in capsys.readouterr().out
    for bad in (["--num-blocks", "0"], ["--block-size", "0"], ["--min-run", "0"]):
        bad = ["--num-blocks", "8", *bad] if bad[0] != "--num-blocks" else bad
        assert main([*argv[:2], "--model", str(model_dir), *bad]) == 2
        assert "must be" in capsys.readouterr().out


def test_common_prefix_len_against_a_loop():
    import random

    rng = random.Random(5)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 400))]
        b = a[: rng.randrange(len(a) + 1)] + [
            rng.randrange(3) for _ in range(rng.randrange(0, 300))
        ]
        i, j = rng.randrange(len(a) + 1), rng.randrange(len(b) + 1)
        n = 0
        while i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
            n += 1
        assert dv.common_prefix_len(a, b, i, j) == n
        assert dv.common_prefix_len(a, b) == dv.common_prefix_len(b, a)
