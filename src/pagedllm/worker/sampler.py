"""Sampling from a batch of logits, vectorised over the batch.

Rows: one logits row per scheduled sequence with ``num_samples > 0``, in order.
A row with ``num_samples = n`` (a parent of parallel samples finishing its prompt)
is repeated n times and each copy drawn independently. The pipeline, per row::

    raw logits --(logit_bias, penalties, min_tokens mask)--> processed
        greedy rows: argmax(processed)
        others:      processed / temperature -> top_k, top_p, min_p masks
                     -> draw (inverse CDF: one uniform number per row, found in the
                        row's cumulative probabilities; a seeded request draws its
                        number from its own torch.Generator, so its tokens do not
                        depend on the batch)
    logprobs (when asked): log_softmax of the raw logits, top-k and the rank

Two stages have a fast path beside their plain reference (``Sampler(fast_sampling=False)``
runs the references; tests hold the two to the same tokens): the draw is one C++ pass per row
(``kernels.ops.sample_rows``: temperature, softmax and a blocked inverse CDF, reading bf16
logits as they come; where it does not apply, ``inverse_cdf_blocked`` over torch's softmax;
the plain ``inverse_cdf`` takes a float64 cumulative sum over the whole vocabulary), and
top_k / top_p sort only the ``torch.topk`` candidates when they provably hold every kept
token (``filter_top_k_top_p``; the plain ``_filter`` sorts the whole vocabulary, tens of ms
for 16 rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedllm.core.outputs import (
    ModelRunnerOutput,
    ScheduledSequence,
    TokenLogprob,
    position_masks,
)
from pagedllm.kernels.ops import argmax_rows, sample_rows
from pagedllm.sampling_params import SamplingParams

_DEFAULT_PARAMS = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _Rows:
    """The batch expanded to one row per sample (internal)."""

    seqs: list[ScheduledSequence]  # one per sample row
    params: list[SamplingParams]
    source: torch.Tensor  # [S] index into the logits rows


class Sampler:
    """Turns logits (one row per scheduled sequence with ``num_samples > 0``, in order)
    into a ``ModelRunnerOutput`` aligned with all scheduled sequences.

    ``fast_greedy``: when every sampling row is plain greedy (no logit bias, penalties,
    active min_tokens mask or logprobs), take one argmax of the raw logits and skip the
    general pipeline; ``False`` always runs the general pipeline (the ground truth).
    ``fast_sampling``: the blocked inverse CDF and the top-k candidate filter (see the
    module docstring); ``False`` runs their plain references.
    """

    def __init__(self, *, fast_greedy: bool = True, fast_sampling: bool = True) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self.fast_greedy = fast_greedy
        self.fast_sampling = fast_sampling

    def __call__(
        self,
        logits: torch.Tensor,
        scheduled: Sequence[ScheduledSequence],
        *,
        fast_path: bool | None = None,
    ) -> ModelRunnerOutput:
        """``logits``: float32 or the model's dtype (bf16/fp16). Each stage that computes in
        float32 upcasts what it reads (bf16/fp16 widen exactly, so the values are those of
        float32 logits); model-dtype logits save the copy where no stage needs one
        (``takes_model_dtype``). ``fast_path``: ``uses_fast_path``'s answer, when the
        caller already has it (``None``: ask)."""
        if fast_path is None:
            fast_path = self.uses_fast_path(scheduled)
        if fast_path:
            return self._greedy(logits, scheduled)
        rows = self._expand(scheduled, logits.device)
        if not rows.seqs:
            return ModelRunnerOutput(
                sampled_token_ids=tuple(() for _ in scheduled),
                logprobs=tuple(None for _ in scheduled),
            )
        processed = self._process(logits, rows)
        tokens = self._draw(processed, rows)
        logprobs = self._logprobs(logits, tokens, rows)
        return self._assemble(scheduled, tokens.tolist(), logprobs)

    def uses_fast_path(self, scheduled: Sequence[ScheduledSequence]) -> bool:
        """True when this batch takes the greedy fast path: an argmax of the logits as
        they come, so the caller need not upcast them to float32 first."""
        return self.fast_greedy and all(
            _every_row(seq, SamplingParams.plain_greedy) for seq in scheduled
        )

    def takes_model_dtype(self, scheduled: Sequence[ScheduledSequence]) -> bool:
        """True when this batch's logits can come in the model's dtype (bf16/fp16): the
        greedy fast path, or only plain random draws (``sample_rows`` reads bf16 logits
        as they are; the torch pipeline upcasts them itself where it has to run)."""
        if self.uses_fast_path(scheduled):
            return True
        return self.fast_sampling and all(
            _every_row(seq, SamplingParams.plain_random) for seq in scheduled
        )

    def release(self, request_ids: frozenset[str] | Sequence[str]) -> None:
        """Drop per-request state (seeded generators) of finished requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _greedy(
        self, logits: torch.Tensor, scheduled: Sequence[ScheduledSequence]
    ) -> ModelRunnerOutput:
        """One argmax per logits row."""
        return self.greedy_from_argmax(_argmax_rows(logits) if logits.shape[0] else [], scheduled)

    def greedy_from_argmax(
        self, best: list[int], scheduled: Sequence[ScheduledSequence]
    ) -> ModelRunnerOutput:
        """The fast path's output from each sampled row's argmax (``best``, in the order of
        the sequences with ``num_samples > 0``): a row with n samples gives n copies."""
        if len(best) == len(scheduled) and all(seq.num_samples == 1 for seq in scheduled):
            # Plain decode: one token per sequence.
            return ModelRunnerOutput(tuple((t,) for t in best), (None,) * len(best))
        tokens: list[int] = []
        row = 0
        for seq in scheduled:
            if seq.num_samples:
                tokens.extend([best[row]] * seq.num_samples)
                row += 1
        return self._assemble(scheduled, tokens, [None] * len(tokens))

    # ------------------------------------------------------------------ stages

    def _expand(self, scheduled: Sequence[ScheduledSequence], device: torch.device) -> _Rows:
        seqs, params, source = [], [], []
        row = 0
        for seq in scheduled:
            if seq.num_samples == 0:
                continue
            p = seq.sampling_params or _DEFAULT_PARAMS
            for _ in range(seq.num_samples):
                seqs.append(seq)
                params.append(p)
                source.append(row)
            row += 1
        return _Rows(seqs, params, torch.tensor(source, dtype=torch.long, device=device))

    def _process(self, raw: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """Logit bias, penalties and the min_tokens mask, on one float32 row per sample.
        With nothing to apply: ``raw`` itself (not written) when it already has one row per
        sample, else its rows repeated per sample, in its dtype."""
        altered = any(_alters_logits(s, p) for s, p in zip(rows.seqs, rows.params, strict=True))
        if len(rows.params) == raw.shape[0] and not altered:
            return raw
        logits = raw[rows.source]  # indexing copies: written below
        if not altered:
            return logits
        logits = logits.float()
        self._apply_logit_bias(logits, rows)
        if any(p.needs_penalties for p in rows.params):
            self._apply_penalties(logits, rows)
        self._mask_early_stops(logits, rows)
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, rows: _Rows) -> None:
        vocab = logits.shape[1]
        for i, p in enumerate(rows.params):
            if p.logit_bias:
                ids = [t for t in p.logit_bias if t < vocab]
                values = [p.logit_bias[t] for t in ids]
                logits[i, ids] += torch.tensor(values, dtype=logits.dtype, device=logits.device)

    def _apply_penalties(self, logits: torch.Tensor, rows: _Rows) -> None:
        num_rows, vocab = logits.shape
        device = logits.device
        output_counts = _token_counts(
            [s.output_token_ids for s in rows.seqs], num_rows, vocab, device
        )
        prompt_seen = (
            _token_counts([s.prompt_token_ids for s in rows.seqs], num_rows, vocab, device) > 0
        )
        seen = prompt_seen | (output_counts > 0)
        rep = _column([p.repetition_penalty for p in rows.params], device)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
        freq = _column([p.frequency_penalty for p in rows.params], device)
        presence = _column([p.presence_penalty for p in rows.params], device)
        logits -= freq * output_counts + presence * (output_counts > 0).float()

    def _mask_early_stops(self, logits: torch.Tensor, rows: _Rows) -> None:
        vocab = logits.shape[1]
        for i, (seq, p) in enumerate(zip(rows.seqs, rows.params, strict=True)):
            if p.min_tokens_pending(len(seq.output_token_ids)):
                ids = [t for t in p.all_stop_token_ids if t < vocab]
                if ids:
                    logits[i, ids] = float("-inf")

    def _draw(self, logits: torch.Tensor, rows: _Rows) -> torch.Tensor:
        random_rows = [i for i, p in enumerate(rows.params) if not p.greedy]
        if len(random_rows) == len(rows.params):  # no argmax or row selection needed
            return self._draw_random(logits, rows.seqs, rows.params)
        tokens = logits.argmax(dim=-1)
        if random_rows:
            index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
            tokens[index] = self._draw_random(
                logits[index],
                [rows.seqs[i] for i in random_rows],
                [rows.params[i] for i in random_rows],
            )
        return tokens

    def _draw_random(
        self, logits: torch.Tensor, seqs: list[ScheduledSequence], params: list[SamplingParams]
    ) -> torch.Tensor:
        """One draw per row of ``logits`` (every row samples; ``logits`` is not written).

        Fast: rows without top_k / top_p / min_p go straight to ``sample_rows`` (temperature,
        softmax and the inverse CDF in one pass over the logits as they come); with them,
        the filters run on torch and ``sample_rows`` draws from what they keep. Where the
        kernel does not apply, the blocked inverse CDF over torch's softmax. Reference:
        one full sort for the filters, the plain float64 inverse CDF."""
        uniform = self._uniform(seqs, params, logits.device)
        filters = any(p.filters for p in params)
        if self.fast_sampling and not filters:
            inverse = [1.0 / p.temperature for p in params]
            tokens = sample_rows(logits, torch.tensor(inverse, dtype=torch.float32), uniform)
            if tokens is not None:
                return tokens
        logits = logits.float()
        if any(p.temperature != 1.0 for p in params):
            logits = logits / _column([p.temperature for p in params], logits.device)
        if not self.fast_sampling:
            return inverse_cdf(torch.softmax(_filter(logits, params), dim=-1), uniform)
        logits = _filter_min_p(filter_top_k_top_p(logits, params), params)
        tokens = sample_rows(logits, torch.ones(len(params)), uniform) if filters else None
        if tokens is not None:
            return tokens
        return inverse_cdf_blocked(torch.softmax(logits, dim=-1), uniform)

    def _uniform(
        self, seqs: list[ScheduledSequence], params: list[SamplingParams], device: torch.device
    ) -> torch.Tensor:
        """One U[0, 1) number per row; seeded requests draw theirs from their own
        generator, in sample order. Float32 draws: strictly below 1 after scaling (see
        ``inverse_cdf``)."""
        uniform = torch.rand(len(seqs), device=device)
        for i, (seq, p) in enumerate(zip(seqs, params, strict=True)):
            if p.seed is not None:
                generator = self._generator(seq, p.seed, device)
                uniform[i] = torch.rand(1, generator=generator, device=device)[0]
        return uniform

    def _generator(
        self, seq: ScheduledSequence, seed: int, device: torch.device
    ) -> torch.Generator:
        """The sequence's own generator: parallel sample j of a request draws from
        ``seed + j``, so that the n samples differ and each is reproducible."""
        generator = self._generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed((seed + seq.sample_index) % (2**63))
            self._generators[seq.request_id] = generator
        return generator

    def _logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, rows: _Rows
    ) -> list[TokenLogprob | None]:
        """Per sample row, its logprobs when asked (``raw``: one row per sequence that
        samples, as ``rows.source`` indexes it)."""
        wanted = [i for i, p in enumerate(rows.params) if p.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(rows.params)
        if not wanted:
            return result
        index = torch.tensor(wanted, dtype=torch.long, device=raw.device)
        found = token_logprobs(
            raw[rows.source[index]], tokens[index], [rows.params[i].logprobs or 0 for i in wanted]
        )
        for i, logprob in zip(wanted, found, strict=True):
            result[i] = logprob
        return result

    # ---------------------------------------------------- speculative verification

    def generator_states(
        self, seqs: Sequence[ScheduledSequence], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """The state of each seeded sequence's generator (made if it has none yet), by
        request id: a verification draws for every scored position, then rewinds to the
        tokens it kept (``rewind_generators``; ``worker/spec_verify.py``)."""
        states = {}
        for seq in seqs:
            params = seq.sampling_params
            if params is not None and params.seed is not None and not params.greedy:
                generator = self._generator(seq, params.seed, device)
                states[seq.request_id] = generator.get_state()
        return states

    def rewind_generators(
        self, states: dict[str, torch.Tensor], draws: dict[str, int], device: torch.device
    ) -> None:
        """Put each generator of ``states`` back and advance it by ``draws[id]`` draws, one
        per token kept, as ``_uniform`` draws them."""
        for request_id, state in states.items():
            generator = self._generators[request_id]
            generator.set_state(state)
            for _ in range(draws.get(request_id, 0)):
                torch.rand(1, generator=generator, device=device)

    @staticmethod
    def _assemble(
        scheduled: Sequence[ScheduledSequence],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> ModelRunnerOutput:
        sampled: list[tuple[int, ...]] = []
        per_seq_logprobs: list[tuple[TokenLogprob, ...] | None] = []
        row = 0
        for seq in scheduled:
            k = seq.num_samples
            sampled.append(tuple(tokens[row : row + k]))
            lps = logprobs[row : row + k]
            per_seq_logprobs.append(tuple(lps) if k and all(lp is not None for lp in lps) else None)
            row += k
        return ModelRunnerOutput(sampled_token_ids=tuple(sampled), logprobs=tuple(per_seq_logprobs))


def bitmask_rows(
    scheduled: Sequence[ScheduledSequence], token_bitmasks: Mapping[str, bytes]
) -> tuple[list[int], list[bytes]]:
    """The logits rows (one per sequence with ``num_samples > 0``, in order; one per scored
    position of a sequence with drafts) that ``SchedulerOutput.token_bitmasks``
    constrains, and their masks."""
    rows: list[int] = []
    masks: list[bytes] = []
    row = 0
    for seq in scheduled:
        if not seq.num_samples:
            continue
        positions = 1 + seq.num_draft_tokens
        mask = token_bitmasks.get(seq.request_id)
        if mask is not None:
            rows.extend(range(row, row + positions))
            masks.extend(position_masks(mask, positions))  # type: ignore[arg-type]
        row += positions
    return rows, masks


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], masks: Sequence[bytes]) -> None:
    """Structured outputs: in ``logits`` (written in place), set to -inf every token that
    row ``rows[i]``'s mask ``masks[i]`` forbids (bit ``t % 32`` of little-endian 32-bit word
    ``t // 32`` clear: token t is forbidden; tokens past the mask are forbidden). Runs
    before any other stage, so greedy, sampled, n>1 and logprobs all see the masked rows.

    On CPU the rows are written through an integer view of their bits, branch-free
    (``value & keep | -inf & ~keep``, ``keep`` all ones or zeros per token): a boolean
    select over a mask of scattered bits mispredicts, and torch's element-wise ops pay
    for their threads on a busy machine; the plain ``masked_fill`` is kept for other
    devices and dtypes (and as the tests' reference)."""
    if not rows:
        return
    num_rows, vocab = len(rows), logits.shape[1]
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(num_rows, -1)
    # count pads with zero bits: a mask shorter than the vocabulary forbids the rest.
    allowed = np.unpackbits(packed, axis=1, count=vocab, bitorder="little")
    bits = _NEG_INF_BITS.get(logits.dtype)
    with torch.inference_mode():  # the runner's logits are inference tensors
        if logits.device.type == "cpu" and logits.is_contiguous() and bits is not None:
            raw = logits.view(bits[0]).numpy()
            every_row = list(rows) == list(range(logits.shape[0]))
            target = raw if every_row else raw[list(rows)]
            keep = np.negative(allowed, dtype=target.dtype)  # 1 -> all ones, 0 -> 0
            target &= keep
            target |= np.invert(keep) & bits[1]
            if not every_row:
                raw[list(rows)] = target
            return
        forbidden = torch.from_numpy(allowed == 0).to(logits.device)
        index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def forbidden_argmax(
    best: Sequence[int], rows: Sequence[int], masks: Sequence[bytes]
) -> tuple[list[int], list[bytes]]:
    """Greedy rows (``bitmask_rows``' ``rows`` and ``masks``) whose unmasked argmax
    ``best[row]`` their mask forbids, and those masks. Every other masked row's argmax is
    already the masked argmax, so only these need their logits and ``apply_token_bitmask``."""
    redo_rows: list[int] = []
    redo_masks: list[bytes] = []
    for row, mask in zip(rows, masks, strict=True):
        token = best[row]
        if token // 8 >= len(mask) or not mask[token // 8] >> (token % 8) & 1:
            redo_rows.append(row)
            redo_masks.append(mask)
    return redo_rows, redo_masks


# A float dtype's integer view and the bits of its -inf in that view.
_NEG_INF_BITS = {
    dtype: (view, torch.tensor(float("-inf"), dtype=dtype).view(view).item())
    for dtype, view in (
        (torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)
    )
}  # fmt: skip


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Row-wise argmax as ints (first index of the maximum, NaN wins, as torch.argmax).

    ``argmax_rows`` is the C++ kernel on CPU float32/bf16 logits (no float32 copy of bf16
    logits, a vectorised scan instead of torch's reduction) and torch's argmax elsewhere.
    """
    return argmax_rows(logits).tolist()


def _alters_logits(seq: ScheduledSequence, params: SamplingParams) -> bool:
    """True when ``_process`` changes this row: a logit bias, penalties or the
    min_tokens mask."""
    return (
        bool(params.logit_bias)
        or params.needs_penalties
        or params.min_tokens_pending(len(seq.output_token_ids))
    )


def _every_row(seq: ScheduledSequence, check: Callable[[SamplingParams, int], bool]) -> bool:
    """``check(params, num_output)`` for this sequence's next token (True when it samples
    no row): ``SamplingParams.plain_greedy`` or ``plain_random``."""
    if seq.num_samples == 0:
        return True
    p = seq.sampling_params or _DEFAULT_PARAMS
    return check(p, len(seq.output_token_ids))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _token_counts(
    token_lists: list[Sequence[int]], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab] float counts of each token id (ids >= vocab are ignored)."""
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=device)
    longest = max((len(t) for t in token_lists), default=0)
    if longest:
        ids = torch.full((num_rows, longest), vocab, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            if tokens:
                ids[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long).clamp_(
                    0, vocab
                )
        ids = ids.to(device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``uniform`` times
    the row's total: a draw from ``probs``. Float64 sums, so that a token of tiny
    probability keeps its share of [0, 1); a zero-probability token is never chosen
    (its cumulative value equals its predecessor's). One random number per row, where an
    exponential race (argmax of probs / Exp(1) noise) needs one per vocabulary entry."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniform.to(torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)


def inverse_cdf_blocked(
    probs: torch.Tensor, uniform: torch.Tensor, block: int = 256
) -> torch.Tensor:
    """``inverse_cdf`` in two searches: the float64 cumulative sums of blocks of ``block``
    tokens find the block, then that block's own cumulative sums find the token. Same
    draw (up to float64 rounding at a boundary), same edges: a zero-probability token is
    never chosen, a tiny one keeps its share."""
    num_rows, vocab = probs.shape
    if num_rows == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    padded = torch.nn.functional.pad(probs, (0, -vocab % block)) if vocab % block else probs
    blocks = padded.view(num_rows, -1, block)
    num_blocks = blocks.shape[1]
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum_(dim=-1)
    target = uniform.to(torch.float64)[:, None] * block_cdf[:, -1:]
    found = torch.searchsorted(block_cdf, target, right=True).clamp_max_(num_blocks - 1)
    before = block_cdf.gather(1, (found - 1).clamp_min(0)).masked_fill_(found == 0, 0.0)
    chosen = blocks[torch.arange(num_rows, device=probs.device), found[:, 0]]  # [rows, block]
    inner = torch.searchsorted(
        chosen.cumsum(dim=-1, dtype=torch.float64), target - before, right=True
    )
    # Rounding can leave the target past the block's own sum: take its last nonzero token.
    positions = torch.arange(1, block + 1, device=probs.device)
    last = ((chosen > 0) * positions).argmax(dim=-1, keepdim=True)
    return (found * block + torch.minimum(inner, last)).squeeze(1)


# top_p rows without top_k: how many candidates ``filter_top_k_top_p`` tries before it
# sorts the whole vocabulary (a peaked distribution's nucleus fits in the first).
_TOP_P_CANDIDATES = (256, 4096)


def filter_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``_filter``'s top_k and top_p masks, sorting only ``torch.topk`` candidates: the
    largest top_k of the rows that filter, or more when a top_p row has no top_k (enough
    that their probability mass exceeds its top_p; else ``_filter``'s full sort). The same
    tokens are kept as by the full sort, up to float32 rounding at the top_p boundary and
    the order of ties. Rows that filter nothing are left as they are."""
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    rows = [i for i, p in enumerate(params) if top_k[i] < vocab or p.top_p < 1.0]
    if not rows:
        return logits
    if len(rows) < len(params):
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out = logits.clone()
        out[index] = filter_top_k_top_p(logits[index], [params[i] for i in rows])
        return out
    largest_k = max((k for k in top_k if k < vocab), default=0)
    sizes = [largest_k] if largest_k and all(k < vocab for k in top_k) else []
    sizes += [size for size in _TOP_P_CANDIDATES if largest_k < size < vocab]
    for size in sizes:
        filtered = _filter_candidates(logits, top_k, [p.top_p for p in params], size)
        if filtered is not None:
            return filtered
    return _filter(logits, [replace(p, min_p=0.0) for p in params])


def _filter_candidates(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], size: int
) -> torch.Tensor | None:
    """The top_k / top_p masks from each row's ``size`` largest logits (every row has
    ``top_k <= size`` or a top_p); None when some row's nucleus may reach past them."""
    vocab = logits.shape[1]
    device = logits.device
    k_column = torch.tensor(top_k, device=device)[:, None]
    p_column = _column(top_p, device)
    values, order = logits.topk(size, dim=-1)
    remove = torch.arange(size, device=device)[None, :] >= k_column
    kept = values.masked_fill(remove, float("-inf"))
    # Probabilities after top_k: over the kept candidates, or the whole vocabulary.
    norm = torch.where(
        k_column < vocab,
        torch.logsumexp(kept, dim=-1, keepdim=True),
        torch.logsumexp(logits, dim=-1, keepdim=True),
    )
    probs = torch.exp(kept - norm)
    cumulative = probs.cumsum(dim=-1)
    # A row without top_k drops every token past the candidates only if their mass
    # exceeds its top_p (then the first token past them has more than top_p before it).
    if bool(((k_column > size) & (cumulative[:, -1:] <= p_column)).any()):
        return None
    remove |= (cumulative - probs) > p_column
    remove[:, 0] = False  # always keep the most likely token
    filtered = torch.full_like(logits, float("-inf"))
    return filtered.scatter_(1, order, values.masked_fill(remove, float("-inf")))


def _filter_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``_filter``'s min_p mask alone."""
    min_p = [p.min_p for p in params]
    if not any(p > 0.0 for p in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * _column(min_p, logits.device)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top_k, top_p and min_p masks (set to -inf), one sort for the whole batch (the
    plain reference of ``filter_top_k_top_p`` and ``_filter_min_p``)."""
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    device = logits.device
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        position = torch.arange(vocab, device=device)[None, :]
        remove = position >= torch.tensor(top_k, device=device)[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        remove |= before > _column(top_p, device)
        remove[:, 0] = False  # always keep the most likely token
        logits = logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * _column(min_p, device)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprob]:
    """Row r's log-probability of ``token_ids[r]`` (log_softmax of the raw ``logits``), its
    rank (1 = most likely) and the ``num_top[r]`` most likely tokens with theirs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > chosen_lp[:, None]).sum(dim=-1) + 1
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen_list, lp_list, rank_list = token_ids.tolist(), chosen_lp.tolist(), ranks.tolist()
    top_ids_list = top_ids.tolist() if k else None
    top_lp_list = top_lp.tolist() if k else None
    return [
        TokenLogprob(
            token_id=chosen_list[r],
            logprob=lp_list[r],
            rank=rank_list[r],
            top_token_ids=tuple(top_ids_list[r][:num]) if num else (),
            top_logprobs=tuple(top_lp_list[r][:num]) if num else (),
        )
        for r, num in enumerate(num_top)
    ]
