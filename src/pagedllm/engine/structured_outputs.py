"""Structured outputs: grammars compiled off the step loop, one matcher per sequence.

::

    StructuredOutputsParams --GrammarCompiler--> Grammar        (worker threads; cached by
                                                                 sha256 of kind, spec, options
                                                                 under one tokenizer; timed)
    Grammar --SequenceMatchers.advance--> a sequence's matcher  (a copy of the start state that
                                                                 has consumed its output tokens)
    matchers --bitmasks(scheduled)--> SchedulerOutput.token_bitmasks --worker--> masked logits

The grammar engine is llguidance. A matcher is keyed by its sequence's request id and lives
in the engine, never in the KV cache: chunked prefill, preemption (recompute or swap), the
disk tier and copy-on-write move blocks, not output tokens, so the matcher stays right. Where
a sequence has no matcher yet (a parallel sample just forked) or one that has consumed more
than its output (never in this engine, but cheap to check), it is rebuilt from the output
tokens: a copy of the grammar's start state consumes them, nothing is guessed.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import llguidance

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.engine.config import DEFAULT_GRAMMAR_COMPILE_LIMIT_S
from pagedllm.sampling_params import StructuredOutputsParams

# Compiled grammars kept per tokenizer (each holds its lexer: kilobytes to a few MB).
DEFAULT_MAX_CACHED = 256
_COMPILE_THREADS = 2
# Free whitespace between JSON tokens (unless disable_any_whitespace): JSON's four
# whitespace characters, at most this many in a row; an endless run is how a small model
# most often fails an unbounded-whitespace grammar (it never reaches the closing brace).
_MAX_WHITESPACE = 32
JSON_WHITESPACE = rf"[\x20\x0A\x0D\x09]{{0,{_MAX_WHITESPACE}}}"


class GrammarError(ValueError):
    """A spec the grammar engine refuses: ``feature`` (a JSON-Schema keyword, format or
    type, when known) at ``path`` (a JSON pointer inside the schema), or the reason."""

    def __init__(
        self, kind: str, reason: str, *, feature: str | None = None, path: str | None = None
    ) -> None:
        self.kind, self.reason, self.feature, self.path = kind, reason, feature, path
        super().__init__(self.message(f"structured_outputs.{kind}"))

    def message(self, field: str) -> str:
        """The error as said of the request field ``field`` (the server's name for it)."""
        if self.feature is not None:
            where = f" at {self.path or '/'}" if self.path is not None else ""
            return f"{field}: unsupported JSON Schema feature {self.feature}{where} ({self.reason})"
        return f"{field}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled spec: llguidance's matcher in its start state (copied for each
    sequence, never advanced itself)."""

    key: str
    start: Any  # llguidance.LLMatcher
    compile_s: float

    def matcher(self) -> Any:
        return self.start.deep_copy()


@dataclass(frozen=True, slots=True)
class CompileStats:
    num_compiled: int  # compiles run (a cache hit runs none)
    num_hits: int
    compile_s: float  # their total time


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer in worker threads, cached.

    ``vocab_size``: the model's (the masks cover it; may exceed the tokenizer's).
    ``eos_token_ids``: the tokens that end a sequence, allowed once the grammar accepts.
    ``submit`` never blocks (the engine's step loop uses it); ``compile`` waits at most
    ``time_limit_s`` (the same spec is refused at once after that) and raises ``GrammarError`` (a ``ValueError``) for a spec the engine
    cannot take or that takes too long. The tokenizer's own table is built once, in a
    worker, as the compiler starts."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] = (),
        *,
        time_limit_s: float = DEFAULT_GRAMMAR_COMPILE_LIMIT_S,
        max_cached: int = DEFAULT_MAX_CACHED,
    ) -> None:
        if tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (this engine has none)")
        self.time_limit_s = time_limit_s
        self.max_cached = max_cached
        self._executor = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        self._tokenizer = self._executor.submit(
            ll_tokenizer, tokenizer, vocab_size, tuple(eos_token_ids)
        )
        self._cache: OrderedDict[str, Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._num_compiled = self._num_hits = 0
        self._compile_s = 0.0

    def key(self, params: StructuredOutputsParams) -> str:
        """sha256 of (kind, canonical spec, options): the cache key under this tokenizer."""
        text = json.dumps([params.kind, params.spec_text(), params.disable_any_whitespace])
        return hashlib.sha256(text.encode()).hexdigest()

    def submit(self, params: StructuredOutputsParams) -> Future[Grammar]:
        """The grammar's future: cached, or compiling in a worker thread (never blocks)."""
        key = self.key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._num_hits += 1
                return future
            future = self._executor.submit(self._compile, key, params)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar, waiting at most ``time_limit_s``; ``GrammarError`` when refused."""
        future = self.submit(params)
        try:
            return future.result(timeout=self.time_limit_s)
        except FutureTimeout:
            error = GrammarError(
                params.kind,
                f"did not compile within {self.time_limit_s:g} s (too large or too "
                "ambiguous); simplify it",
            )
            refused: Future[Grammar] = Future()
            refused.set_exception(error)
            with self._lock:  # the same spec is refused at once from now on
                self._cache[self.key(params)] = refused
            raise error from None

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._num_compiled, self._num_hits, self._compile_s)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: str, params: StructuredOutputsParams) -> Grammar:
        tokenizer = self._tokenizer.result()
        started = time.perf_counter()
        try:
            text = _grammar_text(params)
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        except GrammarError:
            raise
        except Exception as exc:  # llguidance's own refusals of a malformed spec
            raise GrammarError(params.kind, str(exc)) from None
        elapsed = time.perf_counter() - started
        with self._lock:
            self._num_compiled += 1
            self._compile_s += elapsed
        if matcher.is_error():
            raise explain(params, matcher.get_error())
        return Grammar(key, matcher, elapsed)


def ll_tokenizer(tokenizer: Any, vocab_size: int | None, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's table of a Hugging Face fast tokenizer (its Rust ``tokenizers`` JSON).
    ``eos_token_ids``: the tokens that end a sequence (default: the tokenizer's EOS).

    llguidance reads the bytes of every ordinary token from the JSON, but marks every added
    token special (its text is then not its bytes), and cuts text into tokens with special
    tokens split out: a grammar that spells out an added token's text (Qwen2.5's
    ``<tool_call>``) or a special token's got a mask that offered the token and a matcher
    that refused it. So the table is rebuilt from those bytes with only the tokenizer's own
    special tokens special, and text is cut with special tokens read as plain text; an
    added non-special token is then allowed as itself or spelled out, and consumed either
    way."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"structured_outputs needs a fast (tokenizers) tokenizer, not {type(tokenizer).__name__}"
        )
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = list(eos_token_ids) or [tokenizer.eos_token_id]
    n_vocab = max(backend.get_vocab_size(with_added_tokens=True), vocab_size or 0)
    # slices=[]: this table only lends its token bytes; the slicer tables cost most of a build
    table = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos, slices=[])
    added = backend.get_added_tokens_decoder()
    backend.encode_special_tokens = True  # text "<|im_start|>" is its characters, not the token
    wrapper = _TokenTable(
        tokens=[table.decode_bytes([i]) for i in range(n_vocab)],
        special_token_ids=[
            i for i in range(n_vocab)
            if table.is_special_token(i) and (i not in added or added[i].special)
        ],
        eos_token_id=eos[0],
        encode=lambda text: backend.encode(text, add_special_tokens=False).ids,
    )  # fmt: skip
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)


@dataclass(frozen=True, slots=True)
class _TokenTable:
    """What llguidance's ``LLTokenizer`` reads from a Python tokenizer: each token's bytes
    (special ones get llguidance's marker byte), and a call that cuts text into tokens."""

    tokens: list[bytes]
    special_token_ids: list[int]
    eos_token_id: int
    encode: Any  # str -> list[int]
    bos_token_id: int | None = None
    is_tokenizer_wrapper: bool = True

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


def _grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for the spec (cheap: a translation, nothing built yet)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.spec_text()
        if params.disable_any_whitespace:
            options: dict[str, Any] = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": JSON_WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice or ())
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", params.grammar or "")
    except ValueError as exc:  # GBNF that does not convert to Lark
        raise GrammarError(kind, str(exc)) from None


# ---------------------------------------------------------------- naming what was refused

# llguidance's messages for a schema it cannot take, and the feature each names.
_UNIMPLEMENTED = "Unimplemented keys: "
_UNKNOWN_FORMAT = "Unknown format: "
_INVALID_TYPE = "Invalid type: "
_MISSING_POINTER = "Pointer '"


def explain(params: StructuredOutputsParams, reason: str) -> GrammarError:
    """``reason`` (llguidance's message) as a ``GrammarError`` naming the JSON-Schema
    feature and its path inside the schema where both can be found."""
    reason = reason.strip()
    if params.kind != "json":
        return GrammarError(params.kind, reason)
    schema = json.loads(params.spec_text())
    first_line = reason.splitlines()[0] if reason else reason
    if first_line.startswith(_UNIMPLEMENTED):
        try:
            keys = json.loads(first_line.removeprefix(_UNIMPLEMENTED))
        except ValueError:
            keys = []
        for key in keys:
            path = _find(schema, lambda s, k=key: k in s)
            if path is not None:
                return GrammarError("json", reason, feature=f'"{key}"', path=path)
        return GrammarError("json", reason, feature=", ".join(f'"{k}"' for k in keys) or None)
    if first_line.startswith(_UNKNOWN_FORMAT):
        name = first_line.removeprefix(_UNKNOWN_FORMAT)
        path = _find(schema, lambda s: s.get("format") == name)
        return GrammarError("json", reason, feature=f'"format": "{name}"', path=path)
    if first_line.startswith(_INVALID_TYPE):
        name = first_line.removeprefix(_INVALID_TYPE)
        path = _find(schema, lambda s: name in _types(s.get("type")))
        return GrammarError("json", reason, feature=f'"type": "{name}"', path=path)
    if first_line.startswith(_MISSING_POINTER):
        pointer = first_line.removeprefix(_MISSING_POINTER).split("'", 1)[0]
        path = _find(schema, lambda s: str(s.get("$ref", "")).endswith(pointer))
        return GrammarError("json", reason, feature='"$ref"', path=path)
    if first_line.startswith("regex parse error"):
        path = _find(schema, lambda s: isinstance(s.get("pattern"), str) and s["pattern"] in reason)
        if path is not None:
            return GrammarError("json", reason, feature='"pattern"', path=path)
    return GrammarError("json", reason)


def _types(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else",
        "propertyNames", "additionalItems", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _find(schema: object, match: Any) -> str | None:
    """The JSON pointer of the first subschema (depth first) for which ``match`` holds."""
    for path, sub in _subschemas(schema, ""):
        if match(sub):
            return path or "/"
    return None


def _subschemas(schema: object, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _ONE:
        value = schema.get(key)
        if isinstance(value, list):  # the old array form of "items"
            for i, item in enumerate(value):
                yield from _subschemas(item, f"{path}/{key}/{i}")
        else:
            yield from _subschemas(value, f"{path}/{key}")
    for key in _LIST:
        for i, item in enumerate(schema.get(key) or ()):
            yield from _subschemas(item, f"{path}/{key}/{i}")
    for key in _MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, item in value.items():
                yield from _subschemas(item, f"{path}/{key}/{_escape(name)}")


def _escape(name: str) -> str:
    """A JSON-pointer reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


# ---------------------------------------------------------------- one matcher per sequence


class Match(enum.Enum):
    RUNNING = "running"  # more tokens to come
    COMPLETE = "complete"  # the grammar accepts and allows nothing more: finish with "stop"
    REJECTED = "rejected"  # a token the grammar does not allow (the matcher says why)


@dataclass(slots=True)
class _Matcher:
    grammar: Grammar
    matcher: Any  # llguidance.LLMatcher
    num_consumed: int = 0


class SequenceMatchers:
    """The matchers of the constrained sequences, by request id, and their masks.

    ``add`` when a sequence is admitted, ``advance`` after each step with its output tokens,
    ``bitmasks`` before each step, ``release`` when it finishes. ``mask_s`` / ``num_masks``
    total the mask computations (the benchmark reads them)."""

    def __init__(self) -> None:
        self._seqs: dict[str, _Matcher] = {}
        self.mask_s = 0.0
        self.num_masks = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def add(self, seq_id: str, grammar: Grammar) -> None:
        """A sequence at its start state (none of its output consumed)."""
        self._seqs[seq_id] = _Matcher(grammar, grammar.matcher())

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` at ``parent_id``'s state (a beam that continues its parent)."""
        parent = self._seqs[parent_id]
        self._seqs[child_id] = _Matcher(
            parent.grammar, parent.matcher.deep_copy(), parent.num_consumed
        )

    def grammar_of(self, seq_id: str) -> Grammar | None:
        entry = self._seqs.get(seq_id)
        return None if entry is None else entry.grammar

    def advance(
        self, seq_id: str, output_token_ids: Sequence[int], grammar: Grammar | None = None
    ) -> Match:
        """Feed the sequence's output tokens its matcher has not consumed yet. A sequence
        without a matcher gets one from ``grammar`` (a forked sample), rebuilt from all its
        output tokens; so does one that has consumed more tokens than it has."""
        entry = self._seqs.get(seq_id)
        if entry is None or entry.num_consumed > len(output_token_ids):
            source = grammar if entry is None else entry.grammar
            if source is None:
                raise KeyError(f"no grammar for sequence {seq_id!r}")
            entry = self._seqs[seq_id] = _Matcher(source, source.matcher())
        matcher = entry.matcher
        for token in output_token_ids[entry.num_consumed :]:
            if not matcher.consume_token(token):
                return Match.REJECTED
            entry.num_consumed += 1
        return Match.COMPLETE if matcher.is_stopped() else Match.RUNNING

    def error(self, seq_id: str) -> str:
        entry = self._seqs.get(seq_id)
        return "" if entry is None else entry.matcher.get_error()

    def completes_with(self, seq_id: str, token_id: int) -> bool:
        """Whether the sequence's grammar is complete once ``token_id`` follows (asked of a
        copy: the sequence's own matcher does not move)."""
        trial = self._seqs[seq_id].matcher.deep_copy()
        return trial.consume_token(token_id) and trial.is_stopped()

    def bitmasks(self, scheduled: Iterable[ScheduledSequence]) -> dict[str, bytes]:
        """Each constrained sequence that draws this step: its allowed tokens as a
        bitmask (bit ``t % 32`` of little-endian 32-bit word ``t // 32``: token t)."""
        started = time.perf_counter()
        masks = {}
        for seq in scheduled:
            if seq.num_samples:
                entry = self._seqs.get(seq.request_id)
                if entry is not None and seq.num_draft_tokens:
                    masks[seq.request_id] = _draft_bitmasks(entry.matcher, seq.token_ids[1:])
                elif entry is not None:
                    masks[seq.request_id] = entry.matcher.compute_bitmask()
        if masks:
            self.mask_s += time.perf_counter() - started
            self.num_masks += len(masks)
        return masks

    def allowed_drafts(self, seq_id: str, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` (speculative decoding) the sequence's grammar takes
        with room left after them: a draft it refuses could never be accepted, and one that
        completes it would be followed by a token past its end. All for a sequence without
        a matcher."""
        entry = self._seqs.get(seq_id)
        if entry is None:
            return len(drafts)
        trial = entry.matcher.deep_copy()
        for kept, token in enumerate(drafts):
            if not trial.consume_token(token) or trial.is_stopped():
                return kept
        return len(drafts)

    def release(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def ids(self) -> Mapping[str, Any]:
        """The sequences that hold a matcher (tests check none is left behind)."""
        return dict.fromkeys(self._seqs)


def _draft_bitmasks(matcher: Any, drafts: Sequence[int]) -> bytes:
    """A speculating sequence's masks, one per scored position, concatenated
    (``SchedulerOutput.token_bitmasks``): position j's after its first j drafts, from a copy
    of the matcher (the sequence's own moves only with verified tokens). Past a draft the
    grammar refuses (``allowed_drafts`` keeps those out) the last mask is repeated: no token
    from those positions can be kept."""
    masks = [matcher.compute_bitmask()]
    trial = matcher.deep_copy()
    for token in drafts:
        if trial is not None and trial.consume_token(token) and not trial.is_stopped():
            masks.append(trial.compute_bitmask())
        else:
            trial = None
            masks.append(masks[-1])
    return b"".join(masks)
