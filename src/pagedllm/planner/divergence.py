"""Where requests that share a head stop sharing it, and what varies there.

For each request, in log order:

1. ``PrefixIndex.observe``: the longest token prefix it shares with any earlier request
   (``shared``) and that request (``reference``) — exact, from the engine's block hashes
   and the pieces seen after each.
2. ``find_resync``: whether, after a short differing span, it runs on in step with an
   earlier request of the same shape (the best-prefix request, or one found through
   ``AnchorIndex``, windows of 8 tokens indexed just after each request's own
   divergence). A common run of at least ``min_run`` tokens after the span means a
   volatile field in a shared head::

       request i   |== shared head ==|2024-05-01 10:23|==== same text again ====|...
       request j   |== shared head ==|2024-04-30 09:02|==== same text again ====|...
                                     ^ token_index      <------- run ---------->
                                                        recomputed because of the field

3. ``classify``: the kind of the differing text, from the text (regular expressions
   over a window of decoded text around the span, both variants), never from positions.

Requests whose only difference is their tail (a user turn after a byte-identical
system prompt) have no run after it and are never flagged.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("timestamp", "date", "uuid", "hex_id", "number", "name", "text")

ANCHOR_WIDTH = 8
ANCHOR_EVERY = 4  # one position in four (by its token) may begin a window
DEFAULT_MIN_RUN = 32  # tokens in step after the field for it to count
DEFAULT_MAX_GAP = 96  # longest differing span (tokens) taken for a field


def common_prefix_len(a: Sequence[int], b: Sequence[int], i: int = 0, j: int = 0) -> int:
    """Length of the longest common prefix of ``a[i:]`` and ``b[j:]``: slices compared in
    C, in doubling steps (the work follows the answer, not the lengths), then halving."""
    n = min(len(a) - i, len(b) - j)
    lo, step = 0, 64
    while lo < n:
        hi = min(n, lo + step)
        if a[i + lo : i + hi] != b[j + lo : j + hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # a[i:i+lo] == b[j:j+lo], and they differ before hi
        mid = (lo + hi) // 2
        if a[i + lo : i + mid] == b[j + lo : j + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixIndex:
    """The longest prefix each new request shares with an earlier one (same salt).

    Keys are the engine's block hashes (``core.hashing``: a chain over ``block_size``-token
    blocks, salt included), so the whole blocks a request shares are found by lookups.
    The rest, less than a block, is matched against the pieces that followed the deepest
    shared key: the next piece of that key's most recent holder stands for every request
    that went on the same way; where requests went different ways, all the distinct pieces
    are kept sorted, and the longest common prefix with a sorted set is with a neighbour.
    Every distinct piece seen after a key is the holder's next piece or in the sorted list
    (a new one only ever arrives when a request stops matching at that key).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._holder: dict[object, int] = {}  # key -> most recent request going past it
        # key -> the distinct pieces seen after it (sorted) and who last had each
        self._after: dict[object, tuple[list[tuple[int, ...]], dict[tuple[int, ...], int]]] = {}
        self._tokens: dict[int, Sequence[int]] = {}

    def observe(
        self, index: int, tokens: Sequence[int], hashes: Sequence[bytes], salt: str | None
    ) -> tuple[int, int | None]:
        """(shared tokens, reference request) for a prompt whose full blocks have the
        engine hashes ``hashes``; then remember it."""
        bs, holder = self.block_size, self._holder
        depth = 0
        while depth < len(hashes) and hashes[depth] in holder:
            depth += 1
        key = hashes[depth - 1] if depth else ("root", salt)
        base = depth * bs
        reference = holder.get(key)
        if reference is not None and self._tokens[reference][:base] != tokens[:base]:
            # Two prefixes under one key: impossible for sha256 short of a collision;
            # answer with a plain comparison and leave the index as it is.
            return common_prefix_len(tokens, self._tokens[reference]), reference
        shared, piece = base, tuple(tokens[base : base + bs])
        self._tokens[index] = tokens
        if not piece:
            # Nothing past an existing key: the holders of the blocks before it go on as
            # this request does; the key's own holder keeps standing for its piece.
            holder.update(dict.fromkeys(hashes[:-1], index))
            return shared, reference
        for other, owner in self._continuations(key, base, piece, reference):
            n = base + common_prefix_len(piece, other)
            if n > shared:
                shared, reference = n, owner
        self._diverge(key, base, piece, index)
        holder.update(dict.fromkeys(hashes, index))
        holder[key] = index
        return shared, reference

    def _next_piece(self, request: int, base: int) -> tuple[int, ...]:
        return tuple(self._tokens[request][base : base + self.block_size])

    def _continuations(
        self, key: object, base: int, piece: tuple[int, ...], holder: int | None
    ) -> list[tuple[tuple[int, ...], int]]:
        out = [] if holder is None else [(self._next_piece(holder, base), holder)]
        after = self._after.get(key)
        if after:
            pieces, owners = after
            k = bisect.bisect_left(pieces, piece)
            out += [(p, owners[p]) for p in pieces[max(0, k - 1) : k + 1]]
        return out

    def _diverge(self, key: object, base: int, piece: tuple[int, ...], index: int) -> None:
        """A request goes on from ``key`` with ``piece``: keep it, and at the first
        parting of ways the piece the holder stood for."""
        pieces, owners = self._after.setdefault(key, ([], {}))
        holder = self._holder.get(key)
        if holder is not None and not pieces:
            own = self._next_piece(holder, base)
            if own:
                bisect.insort(pieces, own)
                owners[own] = holder
        if piece not in owners:
            bisect.insort(pieces, piece)
        owners[piece] = index


def anchor_positions(tokens: Sequence[int], start: int, stop: int) -> list[int]:
    """Positions in [start, stop] where a window may begin: chosen by the token there
    (one in ``ANCHOR_EVERY``), so equal text is chosen alike in every request."""
    stop = min(stop, len(tokens) - ANCHOR_WIDTH)
    return [q for q in range(max(0, start), stop + 1) if tokens[q] % ANCHOR_EVERY == 0]


def _window(tokens: Sequence[int], q: int) -> tuple[int, ...]:
    return tuple(tokens[q : q + ANCHOR_WIDTH])


class AnchorIndex:
    """Windows of ``ANCHOR_WIDTH`` tokens just after each request's divergence, so that a
    later request differing at the same place finds an earlier one of its own shape."""

    def __init__(self, max_gap: int = DEFAULT_MAX_GAP) -> None:
        self.max_gap = max_gap
        self._windows: dict[tuple, int] = {}

    def add(self, index: int, tokens: Sequence[int], start: int, salt: str | None) -> None:
        stop = start + self.max_gap + ANCHOR_WIDTH
        for q in anchor_positions(tokens, start - ANCHOR_WIDTH, stop):
            self._windows[(salt, _window(tokens, q))] = index

    def candidates(
        self, tokens: Sequence[int], start: int, salt: str | None, limit: int = 3
    ) -> list[int]:
        """Earlier requests sharing windows with the ``max_gap`` tokens after ``start``,
        most windows first: one of the same shape matches all along the text after the
        field, a chance match (a common word inside a free-text field) only once."""
        votes: dict[int, int] = {}
        for q in anchor_positions(tokens, start + 1, start + self.max_gap):
            other = self._windows.get((salt, _window(tokens, q)))
            if other is not None:
                votes[other] = votes.get(other, 0) + 1
        return sorted(votes, key=lambda other: -votes[other])[:limit]


@dataclass(frozen=True, slots=True)
class Resync:
    """A differing span ``tokens[start:end]`` (``other[start:other_end]`` in the earlier
    request) followed by ``run`` tokens in step."""

    other: int
    start: int
    end: int
    other_end: int
    run: int


def find_resync(
    tokens: Sequence[int],
    other_tokens: Sequence[int],
    other: int,
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    min_run: int = DEFAULT_MIN_RUN,
    closing: int = 0,
) -> Resync | None:
    """The first point after their common prefix where the two run in step again for
    ``min_run`` tokens or more, within ``max_gap`` tokens on either side. A run that
    reaches the end of the prompt counts without its last ``closing`` tokens (what every
    prompt of the log ends with, e.g. the chat template's generation prompt): two user
    turns that merely end alike share no head."""
    start = common_prefix_len(tokens, other_tokens)
    windows: dict[tuple[int, ...], int] = {}
    for q in anchor_positions(other_tokens, start, start + max_gap):
        windows.setdefault(_window(other_tokens, q), q)
    for q in anchor_positions(tokens, start, start + max_gap):
        q_other = windows.get(_window(tokens, q))
        if q_other is None:
            continue
        # The windows matched on chosen positions: walk back to where the field ends.
        end, other_end = q, q_other
        while end > start and other_end > start and tokens[end - 1] == other_tokens[other_end - 1]:
            end, other_end = end - 1, other_end - 1
        if end == start and other_end == start:
            continue  # an insertion of nothing: not a field
        run = common_prefix_len(tokens, other_tokens, end, other_end)
        counted = run - closing if end + run == len(tokens) else run
        if counted >= min_run:
            return Resync(other, start, end, other_end, run)
    return None


def closing_len(token_lists: Sequence[Sequence[int]], sample: int = 64) -> int:
    """How many tokens most prompts end with alike: the median common suffix of
    consecutive prompts (of the first ``sample``)."""
    lists = token_lists[: sample + 1]
    lengths = sorted(
        common_prefix_len(a[::-1], b[::-1]) for a, b in zip(lists, lists[1:], strict=False)
    )
    return lengths[len(lengths) // 2] if lengths else 0


# ---- what kind of field -------------------------------------------------------------

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
    r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WEEKDAY = r"(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day"
_DATE = (
    rf"(?:\d{{4}}-\d{{1,2}}-\d{{1,2}}|\d{{1,2}}[/.]\d{{1,2}}[/.]\d{{2,4}}|"
    rf"(?:{_WEEKDAY},? )?{_MONTH}\.? \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}|"
    rf"(?:{_WEEKDAY},? )?\d{{1,2}}(?:st|nd|rd|th)? {_MONTH},? \d{{4}}|{_WEEKDAY})"
)
_TIME = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?: ?[AaPp][Mm])?(?: ?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "uuid",
        re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    ),
    (
        "timestamp",
        re.compile(
            rf"{_DATE}(?:[T ]|,? at )?{_TIME}|{_TIME}|(?<![\d.])1\d{{9}}(?:\d{{3}})?(?!\d|\.\d)"
        ),
    ),
    ("date", re.compile(_DATE)),
    (
        "hex_id",
        re.compile(
            r"(?<![0-9A-Za-z])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}(?![0-9A-Za-z])"
        ),
    ),
    ("number", re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?![\w])")),
    ("name", re.compile(r"(?<![\w'])[A-Z][a-z]+(?:[ -][A-Z][a-z]+){0,2}(?![\w'])")),
)


@dataclass(frozen=True, slots=True)
class FieldText:
    """A differing span as text: ``window[start:end]`` differs from the other request's
    ``other_window[start:other_end]``; the rest of the windows is common."""

    window: str
    start: int
    end: int
    other_window: str
    other_end: int

    @property
    def text(self) -> str:
        return self.window[self.start : self.end]

    @property
    def other_text(self) -> str:
        return self.other_window[self.start : self.other_end]


def field_text(
    before: str, differing: str, other_differing: str, after: str, other_after: str
) -> FieldText:
    """Tighten the token-level span to the characters that differ."""
    head = 0
    while (
        head < min(len(differing), len(other_differing))
        and differing[head] == other_differing[head]
    ):
        head += 1
    tail = 0
    while (
        tail < min(len(differing), len(other_differing)) - head
        and differing[-1 - tail] == other_differing[-1 - tail]
    ):
        tail += 1
    start = len(before) + head
    return FieldText(
        before + differing + after,
        start,
        len(before) + len(differing) - tail,
        before + other_differing + other_after,
        len(before) + len(other_differing) - tail,
    )


def classify(field: FieldText) -> str:
    """The kind of a differing span, read from the text of both variants."""
    return classify_span(field)[0]


def classify_span(field: FieldText) -> tuple[str, int, int, int]:
    """(kind, start, end, other_end): the kind and the whole field — the match of the kind's
    pattern around the differing characters (for free text, the words around them)."""
    for kind, pattern in _PATTERNS:
        mine = _covering(pattern, field.window, field.start, field.end, kind)
        if mine is None:
            continue
        if not field.other_text.strip():
            return kind, mine[0], mine[1], field.other_end
        theirs = _covering(pattern, field.other_window, field.start, field.other_end, kind)
        if theirs is not None:
            return kind, min(mine[0], theirs[0]), mine[1], theirs[1]
    start = _word_start(field.window, field.start)
    return (
        "text",
        start,
        _word_end(field.window, field.end),
        _word_end(field.other_window, field.other_end),
    )


def _covering(
    pattern: re.Pattern[str], window: str, start: int, end: int, kind: str
) -> tuple[int, int] | None:
    """The first match overlapping [start, end); a name must hold the whole span."""
    end = max(end, start + 1)
    for match in pattern.finditer(window):
        if kind == "name":
            if match.start() <= start and end <= match.end():
                return match.span()
        elif match.start() < end and start < match.end():
            return match.span()
    return None


def _word_start(text: str, i: int) -> int:
    while i > 0 and not text[i - 1].isspace():
        i -= 1
    return i


def _word_end(text: str, i: int) -> int:
    while i < len(text) and not text[i].isspace():
        i += 1
    return i


SUGGESTIONS = {
    "timestamp": "a timestamp in the shared head: move it after the stable content (the end of "
    "the system prompt, or the user turn), or round it to the day",
    "date": "a date in the shared head: move it after the stable content (the end of the system "
    "prompt, or the user turn)",
    "uuid": "a UUID (request or session id) in the shared head: move it into the user turn or "
    "request metadata",
    "hex_id": "a hex id in the shared head: move it into the user turn or request metadata",
    "number": "a varying number in the shared head: move it after the stable content",
    "name": "a name (user or tenant) in the shared head: move it into the user turn",
    "text": "text that varies inside a shared head: put stable content first and the varying "
    "text after it (the user turn)",
}
