"""``Speculator``: where speculative decoding sits in the engine's step, and when it pays.

    speculator.propose(scheduler)    drafts on running decodes (Request.draft_token_ids)
    scheduler.schedule()             their slots, within the step's budget (never preempting)
    runner.execute()                 one forward scores every position; drafts verified
    speculator.observe(...)          accepted counts, the step's time
    scheduler.update()               tokens appended, rejected slots rolled back

When it pays (``automatic``): a draft costs about one more query token of the step, and
gains the chance that it and every draft before it are accepted. The speculator keeps

- per sequence, the chance ``rate`` that a draft is accepted given the one before it was
  (from verified drafts, and, while the sequence does not speculate, from the proposals it
  would have made: the next token says whether the first was right, at no cost);
- per engine, the cost of a step as ``fixed + per_token * tokens`` (``StepCostModel``, fit
  to the decode steps it times).

Draft ``j`` of a sequence (expected gain ``rate ** j`` tokens) is kept while
``rate ** j > per_token * tokens / step_time``: the step's throughput lost to one more
token. Memory-bound steps (small batches, where a forward over 5 tokens of a sequence
costs barely more than over 1) take drafts that are often wrong; compute-bound steps
(large batches) take only drafts that are nearly always right, and none when no sequence
is that predictable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.config import EngineConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.proposer import DraftProposer
from pagedllm.spec_decode.suffix import SuffixProposer
from pagedllm.worker.base import ModelRunner

# A sequence's acceptance before anything is known of it, and the weight of the prior, in
# drafts: a few observations outweigh it.
PRIOR_RATE = 0.5
PRIOR_WEIGHT = 2.0
# Weight kept per observation: the estimate follows a sequence whose text changes kind
# (a copied file, then free prose) within a few dozen tokens.
RATE_DECAY = 0.9
# The step cost model's prior (docs/performance.md, "Speculative decoding"): one more token
# costs this share of a one-token decode step until the engine has timed enough steps.
PRIOR_TOKEN_SHARE = 0.02
COST_WINDOW = 256  # decode steps the cost model fits
# A sequence that drafted within this many tokens keeps its steps single (a multi-step
# schedule would run that many tokens without looking for a match again).
HOLD_TOKENS = 16

# How many leading drafts of a request may be verified (structured outputs: its grammar).
DraftCheck = Callable[[Request, Sequence[int]], int]


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Totals since start-up. A *verification* is one sequence's step with drafts."""

    method: str
    num_speculative_tokens: int
    automatic: bool
    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The decode-step cost model now: a one-token step, and one more token.
    step_fixed_s: float = 0.0
    step_token_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average (its accepted drafts and one more;
        1.0 before any)."""
        if not self.num_verifications:
            return 1.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications


class StepCostModel:
    """A decode step's time as ``fixed + per_token * tokens``, a least-squares fit over the
    last ``window`` timed steps; until they vary enough in size, ``per_token`` is the prior
    share of a step's time."""

    def __init__(self, window: int = COST_WINDOW, prior_share: float = PRIOR_TOKEN_SHARE) -> None:
        self.prior_share = prior_share
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._steps.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float]:
        """``(fixed, per_token)`` in seconds (zeros before the first step)."""
        steps = self._steps
        if not steps:
            return 0.0, 0.0
        n = len(steps)
        mean_t = sum(t for t, _ in steps) / n
        mean_s = sum(s for _, s in steps) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in steps) / n
        prior = self.prior_share * mean_s / (1 + self.prior_share * (mean_t - 1))
        if n < 8 or var_t < 1.0:
            return max(mean_s - prior * mean_t, 0.0), prior
        slope = sum((t - mean_t) * (s - mean_s) for t, s in steps) / (n * var_t)
        # A slope the noise of a shared machine pushed below zero, or one far above any
        # linear cost, says nothing: stay near the prior.
        slope = min(max(slope, prior / 4), mean_s)
        return max(mean_s - slope * mean_t, 0.0), slope

    def token_share(self, num_tokens: int) -> float:
        """One more token's cost over a step of ``num_tokens`` tokens' time."""
        fixed, per_token = self.fit()
        total = fixed + per_token * num_tokens
        return per_token / total if total > 0 else self.prior_share


@dataclass(slots=True)
class _Sequence:
    """What the speculator knows of one running sequence (internal)."""

    request: Request
    accepted: float = PRIOR_RATE * PRIOR_WEIGHT  # decayed successes
    trials: float = PRIOR_WEIGHT  # decayed successes and failures
    # A proposal not verified (the sequence took no drafts): the length of the sequence
    # when it was made, and the guesses; the next tokens say how many were right.
    shadow: tuple[int, tuple[int, ...]] | None = None
    proposed_at: int = -(10**9)  # the sequence's length at its last non-empty proposal

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def record(self, successes: int, failed: bool) -> None:
        decay = RATE_DECAY ** (successes + failed)
        self.accepted = self.accepted * decay + successes
        self.trials = self.trials * decay + successes + failed


class Speculator:
    """Proposes drafts for an engine's running decodes and measures what they yield."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.cost = StepCostModel()
        self._seqs: dict[str, _Sequence] = {}
        self._totals = {"verifications": 0, "drafts": 0, "accepted": 0}

    # ---- the step -----------------------------------------------------------------

    def propose(self, scheduler: Scheduler, allowed: DraftCheck | None = None) -> bool:
        """Drafts on the running decodes (``Request.draft_token_ids``) worth verifying;
        ``allowed(request, drafts)``: how many of them may be verified (a grammar's say).
        Returns whether the step should be a single one (no multi-step schedule): some
        sequence drafts, or drafted lately and pays when it does (its proposer found no
        match just now; it likely will a few tokens on)."""
        decodes = [
            r
            for r in scheduler.running
            if len(r.all_token_ids) - r.num_computed_tokens == 1
            and r.output_token_ids
            and not r.score_only  # scored, not extended: nothing to verify a draft against
        ]
        if not decodes:
            return False
        wanted = [min(self.config.num_speculative_tokens, scheduler.max_drafts(r)) for r in decodes]
        proposals = self.proposer.propose(decodes, wanted)
        automatic = self.config.automatic
        share = self.cost.token_share(len(decodes)) if automatic else 0.0
        single = False
        for request, drafts in zip(decodes, proposals, strict=True):
            seq = self._sequence(request)
            self._judge_shadow(seq)
            num_tokens = len(request.all_token_ids)
            keep = self._worth(seq.rate, len(drafts), share) if automatic else len(drafts)
            if keep and allowed is not None:
                keep = allowed(request, drafts[:keep])
            request.draft_token_ids = list(drafts[:keep])
            seq.shadow = (num_tokens, tuple(drafts)) if drafts and not keep else None
            if drafts:
                seq.proposed_at = num_tokens
            pays = keep > 0 or seq.rate > share
            if pays and num_tokens - seq.proposed_at <= HOLD_TOKENS:
                single = True
        return single

    def time_step(self, forward: SchedulerOutput, seconds: float) -> None:
        """The forward of ``forward`` took ``seconds``: a sample for the cost model when
        every sequence decoded (a prompt chunk's cost is not a draft's)."""
        scheduled = forward.scheduled
        if (
            forward.num_steps == 1
            and scheduled
            and all(len(seq.token_ids) == 1 + seq.num_draft_tokens for seq in scheduled)
        ):
            self.cost.observe(forward.num_batched_tokens, seconds)

    def observe(self, forward: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The step ran: count what the drafts yielded."""
        totals = self._totals
        sampled = result.sampled_token_ids
        for i, seq in enumerate(forward.scheduled):
            drafts = seq.num_draft_tokens
            if not drafts or i >= len(sampled) or not sampled[i]:
                continue
            accepted = len(sampled[i]) - 1
            totals["verifications"] += 1
            totals["drafts"] += drafts
            totals["accepted"] += accepted
            state = self._seqs.get(seq.request_id)
            if state is not None:
                state.record(accepted, accepted < drafts)

    def stats(self) -> SpecDecodeStats:
        fixed, per_token = self.cost.fit()
        totals = self._totals
        return SpecDecodeStats(
            method=self.config.method,
            num_speculative_tokens=self.config.num_speculative_tokens,
            automatic=self.config.automatic,
            num_verifications=totals["verifications"],
            num_draft_tokens=totals["drafts"],
            num_accepted_tokens=totals["accepted"],
            step_fixed_s=fixed,
            step_token_s=per_token,
        )

    @property
    def num_tracked(self) -> int:
        """Sequences the speculator keeps state for (tests: none is left behind)."""
        return len(self._seqs)

    # ---- internal -----------------------------------------------------------------

    @staticmethod
    def _worth(rate: float, num_drafts: int, share: float) -> int:
        """How many of ``num_drafts`` drafts to keep: draft j (gain ``rate ** j``) while
        its expected gain exceeds ``share`` (the step throughput one more token costs)."""
        keep, gain = 0, 1.0
        while keep < num_drafts:
            gain *= rate
            if gain <= share:
                break
            keep += 1
        return keep

    def _sequence(self, request: Request) -> _Sequence:
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.request is not request:
            seq = self._seqs[request.request_id] = _Sequence(request)
        return seq

    def _judge_shadow(self, seq: _Sequence) -> None:
        """Score the proposal a sequence did not verify against the tokens that came."""
        if seq.shadow is None:
            return
        length, guesses = seq.shadow
        seq.shadow = None
        came = seq.request.all_token_ids[length : length + len(guesses)]
        right = 0
        while right < len(came) and came[right] == guesses[right]:
            right += 1
        seq.record(right, right < len(came))

    def forget_finished(self, scheduler: Scheduler) -> None:
        """Sequences that left the scheduler (finished, aborted, failed): the proposer's
        last word (a suffix pool learns their text), then their state goes."""
        requests = scheduler.requests
        gone = [rid for rid, seq in self._seqs.items() if requests.get(rid) is not seq.request]
        for request_id in gone:
            self.proposer.request_finished(self._seqs.pop(request_id).request)


def make_proposer(config: SpeculativeConfig) -> DraftProposer:
    """The proposer ``config.method`` names."""
    if config.method == "suffix":
        return SuffixProposer(
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_min_token_prob,
        )
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def speculator_of(config: EngineConfig, runner: ModelRunner) -> Speculator | None:
    """An engine's ``Speculator`` (None: speculative decoding is off); ``ValueError`` for a
    runner that cannot verify drafts."""
    if config.speculative_config is None:
        return None
    if not runner.supports_speculation:
        raise ValueError(f"speculative_config: {type(runner).__name__} cannot verify drafts")
    return Speculator(config.speculative_config)


def speculative_route(config: SpeculativeConfig | None) -> str:
    """The ``Routes.speculative`` line: the proposer, the drafts, how they are verified."""
    if config is None:
        return "off (--speculative-config to draft from the request's own text)"
    if config.method == "suffix":
        source = (
            f"suffix decoding (the request's text and its tenant's last "
            f"{config.suffix_decoding_max_cached_requests} requests)"
        )
    else:
        source = "n-gram prompt lookup (the request's own text)"
    lookup = f"n {config.prompt_lookup_max}..{config.prompt_lookup_min}"
    when = "where they pay (automatic)" if config.automatic else "whenever found"
    return (
        f"{source}, {lookup}, up to {config.num_speculative_tokens} drafts {when}; verified "
        f"as one query of up to {config.num_speculative_tokens + 1} tokens per sequence "
        "through the decode attention kernel"
    )
