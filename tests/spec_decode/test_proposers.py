"""The proposers: n-gram prompt lookup (longest match first, the latest occurrence) and
suffix decoding over a bounded, per-tenant pool of recent requests."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request
from pagedllm.spec_decode.ngram import NgramIndex, NgramProposer, continuation
from pagedllm.spec_decode.proposer import DraftProposer
from pagedllm.spec_decode.suffix import SuffixProposer


def request(tokens, rid="r", salt=None, num_prompt=None) -> Request:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    return Request(rid, tokens[:num_prompt], output_token_ids=tokens[num_prompt:], cache_salt=salt)


def test_ngram_takes_the_longest_match_first():
    # "7 8" last appeared before 1; "5 7 8" (longer) appeared before 2.
    tokens = [5, 7, 8, 2, 2, 9, 7, 8, 1, 1, 5, 7, 8]
    proposer = NgramProposer(1, 3)
    assert proposer.propose_one(request(tokens), 3) == [2, 2, 9]
    shorter = NgramProposer(1, 2)
    assert shorter.propose_one(request(tokens), 3) == [1, 1, 5]


def test_ngram_reads_output_too_and_respects_min_n():
    tokens = [1, 2, 3, 4, 9, 9, 3, 4]
    assert NgramProposer(2, 2).propose_one(request(tokens, num_prompt=3), 2) == [9, 9]
    assert NgramProposer(3, 4).propose_one(request(tokens), 2) == []  # "9 3 4" never seen
    assert NgramProposer(1, 1).propose_one(request([1, 2, 3]), 2) == []


def test_ngram_index_grows_with_the_sequence():
    proposer = NgramProposer(2, 2)
    r = request([1, 2, 3, 1])
    assert proposer.propose_one(r, 2) == []
    r.append_output_token_ids(2)
    assert proposer.propose_one(r, 2) == [3, 1]
    r.append_output_token_ids([3, 1, 2])
    assert proposer.propose_one(r, 4) == [3, 1, 2, 3]  # a loop goes on with its period
    proposer.request_finished(r)
    assert proposer.num_tracked == 0


def test_continuation_extends_a_loop_with_its_period():
    assert continuation([1, 2, 1, 2], 1, 5) == [1, 2, 1, 2, 1]
    assert continuation([4, 4, 4], 1, 3) == [4, 4, 4]
    assert continuation([1, 2, 3, 9, 1, 2], 2, 2) == [9, 1]


def test_index_finds_the_latest_occurrence():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    index.extend(tokens, len(tokens) - 1)
    assert index.find(tokens) == (4, 2)


def test_proposers_follow_the_protocol():
    proposers: list[DraftProposer] = [NgramProposer(1, 2), SuffixProposer(1, 2, 4, 0.1)]
    for proposer in proposers:
        drafts = proposer.propose([request([1, 2, 1]), request([3, 3], "b")], [2, 0])
        assert drafts[1] == [] and isinstance(drafts[0], list)


def test_suffix_drafts_from_a_finished_request_of_the_same_tenant():
    proposer = SuffixProposer(2, 3, max_cached_requests=4, min_token_prob=0.1)
    earlier = request([10, 11, 12, 13, 14, 15], "old", salt="a")
    proposer.request_finished(earlier)
    assert proposer.propose_one(request([1, 11, 12], "new", salt="a"), 3) == [13, 14, 15]
    # Another tenant (or no salt) never sees it.
    assert proposer.propose_one(request([1, 11, 12], "other", salt="b"), 3) == []
    assert proposer.propose_one(request([1, 11, 12], "none"), 3) == []


def test_suffix_follows_the_majority_and_stops_on_a_rare_token():
    proposer = SuffixProposer(2, 2, max_cached_requests=8, min_token_prob=0.5)
    for i, tail in enumerate([[7, 8, 9], [7, 8, 4], [7, 6]]):
        proposer.request_finished(request([1, 2, *tail], f"d{i}"))
    # 7 (3 of 3), 8 (2 of 3), then 9 / 4 at 1 of 2 each: both >= 0.5, the first wins.
    assert proposer.propose_one(request([5, 1, 2], "q"), 4) == [7, 8, 9]
    strict = SuffixProposer(2, 2, max_cached_requests=8, min_token_prob=0.7)
    for i, tail in enumerate([[7, 8, 9], [7, 8, 4], [7, 6]]):
        strict.request_finished(request([1, 2, *tail], f"d{i}"))
    assert strict.propose_one(request([5, 1, 2], "q"), 4) == [7]  # 8 is 2 of 3 < 0.7


def test_suffix_pool_is_bounded_and_forgets_the_oldest():
    proposer = SuffixProposer(2, 2, max_cached_requests=2, min_token_prob=0.1)
    proposer.request_finished(request([1, 2, 3], "a"))
    proposer.request_finished(request([4, 5, 6], "b"))
    proposer.request_finished(request([7, 8, 9], "c"))
    assert proposer.num_cached_requests(None) == 2
    assert proposer.propose_one(request([0, 1, 2], "q"), 1) == []  # "a" was evicted
    assert proposer.propose_one(request([0, 4, 5], "q2"), 1) == [6]
    assert proposer.num_tracked == 2  # q and q2 are running
    for rid in ("q", "q2"):
        proposer.request_finished(request([0], rid))
    assert proposer.num_tracked == 0


def test_suffix_uses_the_request_itself_as_well():
    proposer = SuffixProposer(2, 3, max_cached_requests=0, min_token_prob=0.1)
    assert proposer.propose_one(request([1, 2, 3, 4, 1, 2]), 2) == [3, 4]
    proposer.request_finished(request([1, 2, 3, 4, 1, 2]))
    assert proposer.num_cached_requests(None) == 0  # a pool of none keeps nothing


@pytest.mark.parametrize("min_n,max_n", [(0, 2), (3, 2)])
def test_bad_sizes_are_refused(min_n, max_n):
    with pytest.raises(ValueError):
        NgramProposer(min_n, max_n)
    with pytest.raises(ValueError):
        SuffixProposer(min_n, max_n, 1, 0.1)
