"""Beam search on the paged cache: beams fork and share blocks up to their branch point.

Each round, every live beam has one token not yet computed. When the model has run
it, the beam's logits give its ``2 * beam_width`` best next tokens; once all beams
of a prompt have theirs, the best ``beam_width`` candidates by score are kept::

    beam "The cat"  --fork-->  "The cat sat"   (shares every block of "The cat";
                    --fork-->  "The cat is"     the partial last block is copied on
                                                its first write: copy-on-write)

and the old beams are freed (blocks still held by children stay). A candidate
ending in EOS is complete. With ``structured_outputs``, each beam has its own matcher (a
child's is a copy of its parent's that consumes the new token): every beam's logits are
masked before the top tokens are taken, a masked token is never a candidate, and a candidate
whose grammar is complete is complete too (``finish_reason="stop"``). The algorithm and score are vLLM's ``LLM.beam_search``:
``score = cum_logprob / len(tokens) ** length_penalty`` (prompt included, a final
EOS not counted); scores use the model's log-probabilities.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.outputs import TokenLogprob
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class BeamSearchSequence:
    """One finished beam. ``tokens`` = prompt + output."""

    tokens: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    prompt_token_ids: tuple[int, ...]
    sequences: tuple[BeamSearchSequence, ...]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's score: the cumulative log-probability over length ** length_penalty."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**length_penalty)


@dataclass(slots=True)
class _Beam:
    request_id: str  # its scoring request
    tokens: list[int]  # prompt + output
    cum_logprob: float


@dataclass(slots=True)
class _Candidate:
    tokens: list[int]  # prompt + output
    parent: _Beam
    cum_logprob: float
    score: float
    grammar_complete: bool = False


@dataclass(slots=True)
class _Instance:
    """The beams of one prompt."""

    prompt_token_ids: list[int]
    beams: list[_Beam]
    completed: list[_Candidate] = field(default_factory=list)


class _BeamSearch:
    """One batch of prompts, driven through ``LLMEngine.step`` with scoring requests
    (``engine/scoring.py``): each beam is one, scored and never extended by the step."""

    def __init__(
        self,
        engine: LLMEngine,
        params: BeamSearchParams,
        on_step: Callable[[LLMEngine], None] | None,
    ) -> None:
        self.engine = engine
        self.params = params
        self.on_step = on_step
        self.eos = engine.eos_token_id
        self.sampling = SamplingParams(
            temperature=0.0,
            logprobs=2 * params.beam_width,
            max_tokens=params.max_tokens,
            ignore_eos=True,
        )
        self._ids = (f"__beam-{i}" for i in itertools.count())
        self._results: dict[str, TokenLogprob] = {}
        self.constrained = params.structured_outputs is not None

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        instances: list[_Instance] = []
        try:
            for prompt in prompts:
                instances.append(self._start(prompt))
            while any(inst.beams for inst in instances):
                self._step()
                for inst in instances:
                    if inst.beams and all(b.request_id in self._results for b in inst.beams):
                        self._select(inst)
                if self.on_step is not None:
                    self.on_step(self.engine)
        finally:
            live = [b.request_id for inst in instances for b in inst.beams]
            self.engine.finish_scoring_requests(live, aborted=True)
        return [self._finish(inst) for inst in instances]

    def _start(self, prompt: list[int]) -> _Instance:
        request_id = next(self._ids)
        structured = self.params.structured_outputs
        self.engine.add_scoring_request(request_id, prompt, self.sampling, structured)
        return _Instance(list(prompt), [_Beam(request_id, list(prompt), 0.0)])

    def _step(self) -> None:
        self.engine.step()
        scores = self.engine.take_scores()
        if scores.failed:
            request_id, error = next(iter(scores.failed.items()))
            raise RuntimeError(f"beam search failed: beam {request_id}: {error}")
        self._results.update(scores.top)

    def _select(self, inst: _Instance) -> None:
        width = self.params.beam_width
        candidates = []
        for beam in inst.beams:
            top = self._results.pop(beam.request_id)
            for token, logprob in zip(top.top_token_ids, top.top_logprobs, strict=True):
                if logprob == -math.inf:  # masked by the beam's grammar
                    continue
                candidate = self._candidate(beam.tokens + [token], beam, beam.cum_logprob + logprob)
                if self.constrained:
                    candidate.grammar_complete = self.engine.completes_grammar(
                        beam.request_id, token
                    )
                if candidate.grammar_complete or (token == self.eos and not self.params.ignore_eos):
                    inst.completed.append(candidate)
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda c: c.score, reverse=True)
        chosen = candidates[:width]
        old = [b.request_id for b in inst.beams]
        num_output = len(inst.beams[0].tokens) - len(inst.prompt_token_ids) + 1
        at_limit = (
            num_output >= self.params.max_tokens
            or len(inst.prompt_token_ids) + num_output >= self.engine.max_model_len
        )
        if at_limit:
            inst.completed.extend(chosen)
            inst.beams = []
        else:
            inst.beams = [self._spawn(c) for c in chosen]
        self.engine.finish_scoring_requests(old)

    def _candidate(self, tokens: list[int], parent: _Beam, cum: float) -> _Candidate:
        score = beam_search_score(tokens, cum, self.eos, self.params.length_penalty)
        return _Candidate(tokens, parent, cum, score)

    def _spawn(self, candidate: _Candidate) -> _Beam:
        """The candidate's beam: its parent's request forked with the new token (sharing
        every block; a parent preempted while parked is recomputed)."""
        child_id = next(self._ids)
        parent_id = candidate.parent.request_id
        self.engine.fork_scoring_request(parent_id, child_id, candidate.tokens[-1])
        return _Beam(child_id, candidate.tokens, candidate.cum_logprob)

    def _finish(self, inst: _Instance) -> BeamSearchOutput:
        best = sorted(inst.completed, key=lambda c: c.score, reverse=True)[: self.params.beam_width]
        num_prompt = len(inst.prompt_token_ids)
        sequences = []
        for c in best:
            output = tuple(c.tokens[num_prompt:])
            ended = c.grammar_complete or (
                bool(output) and output[-1] == self.eos and not self.params.ignore_eos
            )
            sequences.append(
                BeamSearchSequence(
                    tokens=tuple(c.tokens),
                    output_token_ids=output,
                    text=self._decode(output),
                    cum_logprob=c.cum_logprob,
                    score=c.score,
                    finish_reason="stop" if ended else "length",
                )
            )
        return BeamSearchOutput(tuple(inst.prompt_token_ids), tuple(sequences))

    def _decode(self, token_ids: Sequence[int]) -> str:
        tokenizer: Any = self.engine.tokenizer
        if tokenizer is None:
            return ""
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def beam_search(
    engine: LLMEngine,
    prompts: Sequence[str | Sequence[int]],
    params: BeamSearchParams,
    *,
    on_step: Callable[[LLMEngine], None] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search for each prompt, on an idle engine (its scheduler and cache).

    Prompts run together, as many at a time as ``max_num_seqs`` allows beams.
    ``on_step(engine)`` is called after every model step (tests watch the blocks).
    """
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if engine.has_unfinished_requests():
        raise ValueError("beam search needs an idle engine (no unfinished requests)")
    max_seqs = engine.config.max_num_seqs
    if params.beam_width > max_seqs:
        raise ValueError(f"beam_width ({params.beam_width}) exceeds max_num_seqs ({max_seqs})")
    token_lists = [engine.tokenize(p) for p in prompts]
    for ids in token_lists:
        engine.check_fits(len(ids), params.max_tokens)
    per_batch = max(1, max_seqs // params.beam_width)
    outputs: list[BeamSearchOutput] = []
    for start in range(0, len(token_lists), per_batch):
        search = _BeamSearch(engine, params, on_step)
        outputs.extend(search.run(token_lists[start : start + per_batch]))
    return outputs
