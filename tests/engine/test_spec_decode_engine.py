"""Speculative decoding on a tiny random Llama: with drafts on, every paging choice
(preemption by recompute and by swap, chunked prefill, prefix hits, an int8 cache, n>1)
gives the tokens it gives with drafts off, and no block is left behind (the engine
fixture checks every pool ends all-free).

Drafts come from a scripted proposer that knows the run without drafts and spoils every
third of its guesses, so that drafts are accepted, rejected at every offset and cross
block boundaries; a random model's own text would rarely repeat."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from pagedllm.core.request import Request
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.conftest import run_all

MAX_TOKENS = 24
BASE = dict(block_size=4, max_model_len=80)
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "automatic": False}


class ScriptedProposer:
    """``DraftProposer`` that drafts a known continuation, every third guess spoiled."""

    def __init__(self, outputs: dict[str, Sequence[int]], vocab_size: int) -> None:
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.finished: list[str] = []

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, max_tokens, strict=True):
            done = request.num_output_tokens
            known = list(self.outputs.get(request.request_id, ())[done : done + k])
            drafts.append(
                [
                    (t + 1) % self.vocab_size if (done + j) % 3 == 2 else t
                    for j, t in enumerate(known)
                ]
            )
        return drafts

    def request_finished(self, request: Request) -> None:
        self.finished.append(request.request_id)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(256) for _ in range(13)]  # a shared prefix, not block-aligned
    return [system + [rng.randrange(256) for _ in range(n)] for n in (3, 9)] + [
        [rng.randrange(256) for _ in range(n)] for n in (1, 17)
    ]


def generate(engine: LLMEngine, params: SamplingParams) -> dict[str, tuple[int, ...]]:
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, params)
    final = run_all(engine)
    return {
        f"{i}#{j}" if j else str(i): c.token_ids
        for i in range(len(prompts()))
        for j, c in enumerate(final[str(i)].outputs)
    }


def with_drafts(engine: LLMEngine, outputs: dict[str, tuple[int, ...]]) -> ScriptedProposer:
    proposer = ScriptedProposer(outputs, engine.runner.vocab_size)
    assert engine.speculator is not None
    engine.speculator.proposer = proposer
    return proposer


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED_N2 = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2, ignore_eos=True)

VARIANTS = {
    "plain": dict(num_blocks=256),
    "chunk-5": dict(num_blocks=256, max_num_batched_tokens=5),
    "recompute-tiny": dict(num_blocks=22, preemption_mode="recompute"),
    "swap-tiny": dict(num_blocks=22, preemption_mode="swap", num_host_blocks=64),
    "int8": dict(num_blocks=256, kv_cache_dtype="int8"),
    "int8-chunk-7": dict(num_blocks=256, kv_cache_dtype="int8", max_num_batched_tokens=7),
    "int8-swap-tiny": dict(
        num_blocks=22, kv_cache_dtype="int8", preemption_mode="swap", num_host_blocks=64
    ),
    "seeded-n2": dict(num_blocks=256),
    "seeded-n2-tiny": dict(num_blocks=30, preemption_mode="swap", num_host_blocks=64),
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_drafts_never_change_the_tokens(name: str, model_engine: Callable[..., LLMEngine]) -> None:
    variant = VARIANTS[name]
    params = SEEDED_N2 if name.startswith("seeded") else GREEDY
    reference = generate(model_engine(**variant, **BASE), params)
    engine = model_engine(**variant, **BASE, speculative_config=SPEC)
    proposer = with_drafts(engine, reference)
    assert generate(engine, params) == reference
    stats = engine.get_stats()
    spec = stats.speculative
    assert spec is not None and spec.num_accepted_tokens > 0
    assert spec.num_accepted_tokens < spec.num_draft_tokens  # some were rejected
    if "tiny" in name:
        assert stats.num_preemptions > 0
    if "swap" in name:
        assert stats.num_preemptions_swap > 0
    engine.step()  # an idle step lets the speculator see the requests have left
    assert engine.speculator.num_tracked == 0 and sorted(proposer.finished)


def test_drafts_save_steps_and_prefix_hits_stay_right(
    model_engine: Callable[..., LLMEngine],
) -> None:
    plain = model_engine(num_blocks=256, **BASE)
    reference = generate(plain, GREEDY)
    engine = model_engine(num_blocks=256, **BASE, speculative_config=SPEC)
    with_drafts(engine, reference)
    assert generate(engine, GREEDY) == reference
    assert engine.num_steps < plain.num_steps * 0.7
    # Again, now partly served from the prefix cache: only verified blocks were published.
    assert generate(engine, GREEDY) == reference
    assert engine.get_stats().cache.prefix_hits_tokens > 0


def test_stops_logprobs_and_penalties_apply_per_accepted_token(
    model_engine: Callable[..., LLMEngine],
) -> None:
    """A stop string inside a step's accepted tokens ends the text where it ends without
    drafts; the logprobs and a repetition penalty are those of one token at a time."""
    base = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    base["repetition_penalty"] = 1.5
    plain = model_engine(num_blocks=256, **BASE)
    outputs = {rid: out.outputs[0] for rid, out in _final(plain, SamplingParams(**base)).items()}
    text = outputs["3"].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(**base, stop=[stop])
    reference = _final(model_engine(num_blocks=256, **BASE), params)
    engine = model_engine(num_blocks=256, **BASE, speculative_config=SPEC)
    with_drafts(engine, {rid: out.token_ids for rid, out in outputs.items()})
    got = _final(engine, params)
    assert engine.get_stats().speculative.num_accepted_tokens > 0
    for rid, out in reference.items():
        want, have = out.outputs[0], got[rid].outputs[0]
        assert (have.text, have.token_ids, have.finish_reason, have.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason,
        )  # fmt: skip
        assert [sorted(p) for p in have.logprobs] == [sorted(p) for p in want.logprobs]
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            for token_id, logprob in a.items():
                assert logprob.logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
    assert reference["3"].outputs[0].finish_reason == "stop"


def _final(engine: LLMEngine, params: SamplingParams) -> dict:
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, params)
    return run_all(engine)
