"""``EngineConfig``: every knob of an engine, validated once, frozen.

Each knob is written once, on its field: the default, and for the knobs that have a
command-line flag the flag's help and unit (``Flag`` in the field's metadata);
``engine/args.py`` builds the flags from them. Sizes are bytes, durations seconds
(a field in seconds ends in ``_s``). What differs between entry points is a named
``Preset`` (``SERVE``, ``OFFLINE``), and a renamed knob's old spelling is a ``Renamed``
entry that still works with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from pagedllm.core.scheduler_config import PREEMPTION_MODES
from pagedllm.kv_dtypes import (
    KV_CACHE_DTYPES,
    UNQUANTIZED_FIRST_BLOCK_DTYPES,
    check_kv_cache_dtype,
    is_quantized,
)
from pagedllm.quant_layout import QUANTIZE_AT_LOAD
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.tool_calls.parsers import TOOL_CALL_PARSERS

GIB = 1 << 30
# Without --kv-cache-memory or --memory-fraction: enough for a few long sessions of
# a small model, and never a surprise on a machine shared with other work.
DEFAULT_KV_CACHE_MEMORY = 1 * GIB
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight formats a float checkpoint is quantized to at load (quant_layout.QUANTIZE_AT_LOAD).
QUANTIZATIONS = tuple(QUANTIZE_AT_LOAD)
# The names pagedllm.attention.select.get_backend accepts (kept here so config stays torch-free).
ATTENTION_BACKENDS = ("auto", "cpu", "reference")
# How tensor-parallel ranks gather activations: "shm" through shared memory (ranks on one
# CPU machine), "gloo" (NCCL on CUDA) through torch.distributed; "auto" picks shm where
# it can run.
TP_COLLECTIVES = ("auto", "shm", "gloo")

BYTES = "bytes"
SECONDS = "seconds"
JSON = "json"
ENGINE_GROUP = "engine"
# A structured-output grammar compiling longer is refused (--grammar-compile-limit).
DEFAULT_GRAMMAR_COMPILE_LIMIT_S = 10.0
TP_GROUP = "tensor parallelism (torch.distributed)"


@dataclass(frozen=True, slots=True)
class Flag:
    """A field's command-line flag: ``--field-name`` (a trailing ``_s`` dropped).

    ``unit`` is shown in ``--help``; ``bytes`` flags take ``4GiB``, ``512MiB`` or a number
    of bytes, ``seconds`` flags ``30``, ``30s`` or ``128ms``, ``json`` flags a JSON object
    (the field's type reads it: ``from_value``). ``max_field``: the flag also takes
    ``MIN:MAX`` and MAX goes to that field.
    """

    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    short: str = ""
    hidden: bool = False
    group: str = ENGINE_GROUP
    max_field: str = ""


def flag(help: str, unit: str = "", **kw: Any) -> dict[str, Flag]:
    """Field metadata giving the field a flag (see ``Flag``)."""
    return {"flag": Flag(help, unit, **kw)}


def flag_name(field_name: str) -> str:
    """``elastic_idle_s`` -> ``--elastic-idle``: the unit suffix is the flag's metavar."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build and run one engine (names as in vLLM where it has them).

    ``kv_cache_memory`` or ``memory_fraction`` (of free memory) sizes the device tier;
    ``num_blocks`` overrides both (tests). ``swap_memory`` sizes the host tier (0
    disables preemption by swap). ``max_model_len=None`` takes the model's limit, capped
    to what the cache holds; ``max_num_batched_tokens=None`` means 2048 with chunked
    prefill, else ``max_model_len``. ``kv_offload_dir`` turns on the disk tier under the
    prefix cache (a directory of its own, kept across restarts), holding at most
    ``kv_offload_size``. Sizes are bytes, durations seconds.
    """

    model: str = field(
        default="default",
        metadata=flag("HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)"),
    )
    dtype: str = field(
        default="auto", metadata=flag("the model's weights and activations", choices=DTYPES)
    )
    quantization: str | None = field(
        default=None,
        metadata=flag(
            "quantize a float checkpoint's linears, embedding and LM head at load, without "
            "calibration data: int8 and q8_0 are both GGUF's Q8_0 layout (int8 weights, an "
            "fp16 scale per 32; ~0.27x float32's bytes), q4_0 GGUF's Q4_0 (4-bit, ~0.14x) "
            "with the head (and a tied embedding) in Q8_0; a GGUF "
            "already quantized is refused unless it is stored in that format",
            choices=QUANTIZATIONS,
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "KV cache format (pagedllm.kv_dtypes): auto (the model's dtype), a float type, or "
            "quantized: int8 (~1.9x the tokens of bf16), int4 (~3x), fp8_e4m3 / fp8_e5m2 "
            "(2x, scale 1)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    kv_cache_unquantized_first_block: bool | None = field(
        default=None,
        metadata=flag(
            "a quantized KV cache keeps each sequence's first block (its first --block-size "
            "tokens, the attention sink) in the model's dtype: about half of int4's "
            "divergence, for one full-precision block per sequence and per cached first "
            "block (at most --max-num-seqs); default: on for int4, off otherwise"
        ),
    )
    block_size: int = field(default=16, metadata=flag("tokens per KV block", "tokens"))
    kv_cache_memory: int | None = field(
        default=None,
        metadata=flag(
            f"KV cache size (default {DEFAULT_KV_CACHE_MEMORY // GIB}GiB); MIN:MAX "
            "(512MiB:4GiB) for the automatic elastic pool: it grows under load up to MAX "
            "and compacts and shrinks toward MIN after --elastic-idle without requests",
            BYTES,
            max_field="kv_cache_memory_max",
        ),
    )
    # The elastic pool's automatic mode (``--kv-cache-memory MIN:MAX``): kv_cache_memory
    # is MIN (the start), this is MAX; the pool shrinks toward MIN after elastic_idle_s.
    kv_cache_memory_max: int | None = None
    elastic_idle_s: float = field(
        default=30.0,
        metadata=flag("time without requests before the elastic pool shrinks", SECONDS),
    )
    # A shrink's compaction takes at most this share of a step's time, per step.
    compaction_step_fraction: float = 0.15
    memory_fraction: float | None = field(
        default=None,
        metadata=flag("KV cache as a fraction of free memory (instead of --kv-cache-memory)",
                      "fraction"),
    )  # fmt: skip
    num_blocks: int | None = field(
        default=None,
        metadata=flag("KV blocks, overriding the sizes (tests)", "blocks", hidden=True),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag("longest prompt + output (default: the model's, capped by the cache)",
                      "tokens"),
    )  # fmt: skip
    max_num_seqs: int = field(default=256, metadata=flag("most sequences in one step", "sequences"))
    # Greedy decode steps per schedule (multi-step decoding; 1: schedule every step).
    num_scheduler_steps: int = field(
        default=1,
        metadata=flag(
            "greedy decode steps run per schedule when every running request decodes "
            "(multi-step decoding: less per-token Python, tokens arrive in bursts)",
            "steps",
        ),
    )
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=flag(
            f"most tokens in one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked "
            "prefill, else --max-model-len)",
            "tokens",
        ),
    )
    # Most prompt tokens in a step that also decodes (None: max_num_batched_tokens); see
    # core.scheduler.SchedulerConfig.
    max_prefill_tokens_while_decoding: int | None = field(
        default=None,
        metadata=flag(
            "most prompt tokens in a step that also decodes: shorter gaps between a stream's "
            "tokens while prompts arrive (default: the step's budget)",
            "tokens",
        ),
    )
    # Or in time: the engine keeps the cap at about this much prompt work, from the steps
    # it measures (engine/prefill_slice.py; max_prefill_tokens_while_decoding, if given
    # too, is the cap until the first prompt step has been timed, and the most the engine
    # picks).
    max_prefill_time_while_decoding_s: float | None = field(
        default=None,
        metadata=flag(
            "the same cap in time: the engine keeps it at the power of two of prompt tokens "
            "nearest to this much prompt work, from the steps it times, at most "
            "--max-prefill-tokens-while-decoding where both are given",
            SECONDS,
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=flag("reuse cached KV blocks of identical prefixes")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=flag("split long prompts across steps")
    )
    # Requests arriving together share a prefix in flight: one computes it, the others
    # wait a step for its blocks (see core/scheduler.py).
    enable_inflight_sharing: bool = field(
        default=True,
        metadata=flag("requests arriving together compute a shared prefix once (the others "
                      "wait a step for its blocks)"),
    )  # fmt: skip
    # A waiting request pins its cached prefix until it is admitted (core/scheduler.py):
    # what a router predicted from the replica's cache is still there when it runs.
    pin_waiting_prefixes: bool = field(
        default=True,
        metadata=flag("a waiting request keeps its cached prefix from eviction until it runs "
                      "(a pin gives way to any allocation that needs the room)"),
    )  # fmt: skip
    preemption_mode: str = field(
        default="auto",
        metadata=flag("what a preempted request loses: recompute its KV or swap it to the "
                      "host tier (--swap-memory); auto picks", choices=PREEMPTION_MODES),
    )  # fmt: skip
    swap_memory: int = field(
        default=0, metadata=flag("host swap tier (for preemption by swap; 0: none)", BYTES)
    )
    num_host_blocks: int | None = None
    kv_offload_dir: str | None = field(
        default=None,
        metadata=flag("disk tier under the prefix cache: full KV blocks are kept in this "
                      "directory (one of its own; kept across restarts) and loaded instead "
                      "of recomputed"),
    )  # fmt: skip
    kv_offload_size: int = field(
        default=16 * GIB,
        metadata=flag("most the disk tier holds, least recently used dropped first", BYTES),
    )
    watermark: float = field(
        default=0.01,
        metadata=flag("blocks admission keeps free for running requests", "fraction"),
    )
    seed: int = field(default=0, metadata=flag("seed of unseeded sampling"))
    # Speculative decoding (spec_decode/config.py; engine/speculator.py): None is off. A dict
    # or its JSON is read into a SpeculativeConfig.
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=flag(
            'speculative decoding, vLLM\'s keys as JSON: {"method": "ngram" | "suffix", '
            '"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}; '
            "drafts from the request's own text (suffix: and its tenant's recent requests), "
            "verified in one forward, each sequence drafting only while it pays (default off)",
            JSON,
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=flag("auto: the fastest available (cpu); reference: the plain ground truth",
                      choices=ATTENTION_BACKENDS),
    )  # fmt: skip
    # torch intra-op threads for the model step; None keeps torch's default (one per core).
    num_threads: int | None = field(
        default=None,
        metadata=flag("torch threads for the model step (default: one per core)", "threads"),
    )
    device: str = field(default="cpu", metadata=flag("torch device: cpu, cuda, cuda:1, ..."))
    # Load no tokenizer: prompts are token ids, outputs token ids (text stays empty).
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=flag("load no tokenizer: requests give token ids and get token ids back"),
    )
    # How chat requests with tools show them and read the model's calls (tool_calls/).
    tool_call_parser: str = field(
        default="auto",
        metadata=flag("the tool-call format of chat requests with tools: auto (read from the "
                      "chat template; generic when it shows no tools), a family (hermes, "
                      "llama3_json, mistral), or generic (tools in a system prompt, "
                      "<tool_call> blocks)", choices=TOOL_CALL_PARSERS),
    )  # fmt: skip
    # Structured outputs: a grammar that compiles longer is refused (a 400 on the server).
    grammar_compile_limit_s: float = field(
        default=DEFAULT_GRAMMAR_COMPILE_LIMIT_S,
        metadata=flag("longest a structured-output grammar (JSON Schema, regex, tool "
                      "schemas) may compile before its request is refused", SECONDS),
    )  # fmt: skip
    # Tensor parallelism (engine/executor/): ranks, and torchrun-style rendezvous
    # across machines (master_port None on one machine: a free port is picked).
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag("ranks sharing every layer (gloo on CPU, NCCL on CUDA); float32 outputs "
                      "are bit-identical to one rank", "ranks", short="-tp", group=TP_GROUP),
    )  # fmt: skip
    nnodes: int = field(
        default=1, metadata=flag("machines the ranks span", "machines", group=TP_GROUP)
    )
    node_rank: int = field(
        default=0,
        metadata=flag("this machine's index; > 0 only starts its ranks (no server)",
                      group=TP_GROUP),
    )  # fmt: skip
    master_addr: str = field(
        default="127.0.0.1", metadata=flag("machine 0's address", group=TP_GROUP)
    )
    master_port: int | None = field(
        default=None,
        metadata=flag("rendezvous port on machine 0 (default on one machine: any free)",
                      group=TP_GROUP),
    )  # fmt: skip
    distributed_timeout_s: float = 300.0
    tp_collective: str = field(
        default="auto",
        metadata=flag("how ranks gather activations: shm (shared memory, one CPU machine), "
                      "gloo, or auto (shm where it can run)", choices=TP_COLLECTIVES,
                      group=TP_GROUP),
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            speculative = SpeculativeConfig.from_value(self.speculative_config)
            object.__setattr__(self, "speculative_config", speculative)
        self._check_positive("block_size", self.block_size)
        self._check_positive("max_num_seqs", self.max_num_seqs)
        self._check_positive("num_scheduler_steps", self.num_scheduler_steps)
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "max_prefill_tokens_while_decoding",
            "kv_cache_memory",
            "kv_cache_memory_max",
        ):
            if getattr(self, name) is not None:
                self._check_positive(name, getattr(self, name))
        for name in ("max_prefill_time_while_decoding_s", "grammar_compile_limit_s"):
            seconds = getattr(self, name)
            if seconds is not None and (
                isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0
            ):
                raise ValueError(f"{name} must be positive, got {seconds!r}")
        for name in ("num_blocks", "num_host_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.kv_cache_memory is not None and self.memory_fraction is not None:
            raise ValueError("give kv_cache_memory or memory_fraction, not both")
        if self.kv_cache_memory_max is not None and (
            self.kv_cache_memory is None or self.kv_cache_memory > self.kv_cache_memory_max
        ):
            raise ValueError("kv_cache_memory_max needs kv_cache_memory (MIN) <= it (MAX)")
        if self.elastic_idle_s < 0:
            raise ValueError(f"elastic_idle_s must be >= 0, got {self.elastic_idle_s}")
        if not 0.0 < self.compaction_step_fraction <= 10.0:
            raise ValueError(
                f"compaction_step_fraction must be in (0, 10], got {self.compaction_step_fraction}"
            )
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        self._check_positive("kv_offload_size", self.kv_offload_size)
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir:
                raise ValueError(f"kv_offload_dir must be a path, got {self.kv_offload_dir!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_dir needs prefix caching (enable_prefix_caching)")
        if isinstance(self.swap_memory, bool) or not isinstance(self.swap_memory, int):
            raise ValueError(f"swap_memory must be a number of bytes, got {self.swap_memory!r}")
        if self.swap_memory < 0:
            raise ValueError(f"swap_memory must be non-negative, got {self.swap_memory}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.num_threads is not None:
            self._check_positive("num_threads", self.num_threads)
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        self._check_distributed()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        check_kv_cache_dtype(self.kv_cache_dtype)
        first = self.kv_cache_unquantized_first_block
        if first is not None and not isinstance(first, bool):
            raise TypeError(
                f"kv_cache_unquantized_first_block must be a bool or None, got {first!r}"
            )
        if first and not is_quantized(self.kv_cache_dtype):
            raise ValueError(
                "kv_cache_unquantized_first_block needs a quantized kv_cache_dtype "
                f"(int8, int4, fp8_e4m3, fp8_e5m2), got {self.kv_cache_dtype!r}"
            )

    @property
    def unquantized_first_block(self) -> bool:
        """Whether the cache keeps first blocks unquantized (the default resolved)."""
        if self.kv_cache_unquantized_first_block is None:
            return self.kv_cache_dtype in UNQUANTIZED_FIRST_BLOCK_DTYPES
        return self.kv_cache_unquantized_first_block

    def _check_distributed(self) -> None:
        self._check_positive("tensor_parallel_size", self.tensor_parallel_size)
        self._check_positive("nnodes", self.nnodes)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of "
                f"nnodes {self.nnodes} (the same number of ranks on every machine)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several machines need --master-addr and --master-port")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.distributed_timeout_s <= 0:
            raise ValueError("distributed_timeout_s must be positive")
        if self.tp_collective not in TP_COLLECTIVES:
            raise ValueError(
                f"tp_collective must be one of {TP_COLLECTIVES}, got {self.tp_collective!r}"
            )
        if self.tp_collective == "shm" and (self.nnodes > 1 or not self.device.startswith("cpu")):
            raise ValueError(
                "tp_collective 'shm' needs every rank on one CPU machine "
                f"(nnodes 1, device cpu; got nnodes {self.nnodes}, device {self.device!r})"
            )

    @staticmethod
    def _check_positive(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max_model_len


def flagged_fields() -> list[tuple[str, Any, Flag]]:
    """(name, default, flag) of every ``EngineConfig`` field that has a flag, in order."""
    return [
        (f.name, f.default, f.metadata["flag"])
        for f in fields(EngineConfig)
        if "flag" in f.metadata
    ]


def field_default(name: str) -> Any:
    """An ``EngineConfig`` field's default (the one place it is written)."""
    default = EngineConfig.__dataclass_fields__[name].default
    assert default is not MISSING, f"EngineConfig.{name} has no default"
    return default


@dataclass(frozen=True, slots=True)
class Default:
    """``field = value`` where the caller gave neither ``field`` nor any of ``unless``;
    with ``needs``, only where that boolean field is on."""

    field: str
    value: Any
    unless: tuple[str, ...] = ()
    needs: str = ""


@dataclass(frozen=True, slots=True)
class Preset:
    """The defaults an entry point sets over ``EngineConfig``'s own, where its caller gave
    no value; a value the caller gives always wins."""

    name: str
    defaults: tuple[Default, ...] = ()

    def apply(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` (the caller's fields) with this preset's defaults added."""
        values = dict(given)
        for default in self.defaults:
            if default.field in given or any(name in given for name in default.unless):
                continue
            if default.needs and not given.get(default.needs, field_default(default.needs)):
                continue
            values[default.field] = default.value
        return values


# `pagedllm serve`, with chunked prefill: a new request's first token should not wait behind
# whole prompts, so a step takes 512 tokens (offline: 2048); decoding streams wait for every
# step, so a step that also decodes takes about 128 ms of prompt work, in time so that one
# default serves fast and slow machines (at most 256 tokens, the cap until a step has been
# timed; a token cap given alone stays a fixed cap). Chosen by measurement
# (docs/performance.md). Without chunked prefill a prompt must fit one step: no caps.
SERVE = Preset(
    "serve",
    (
        Default("max_num_batched_tokens", 512, needs="enable_chunked_prefill"),
        Default("max_prefill_tokens_while_decoding", 256, needs="enable_chunked_prefill"),
        Default(
            "max_prefill_time_while_decoding_s",
            0.128,
            unless=("max_prefill_tokens_while_decoding",),
            needs="enable_chunked_prefill",
        ),
    ),
)
# The offline `LLM`: a batch returns whole completions, so greedy tokens lose nothing by
# arriving 8 at a time, and the per-token Python is paid once for them.
OFFLINE_SCHEDULER_STEPS = 8
OFFLINE = Preset("LLM", (Default("num_scheduler_steps", OFFLINE_SCHEDULER_STEPS),))
# `pagedllm generate` streams one prompt's text token by token: the fields' own defaults.
GENERATE = Preset("generate")
NO_PRESET = Preset("none")


@dataclass(frozen=True, slots=True)
class Renamed:
    """A knob's old name and unit: still accepted (as a keyword and as ``--old-name``),
    with a warning, and converted to the new field."""

    old: str
    new: str
    old_unit: str
    convert: Callable[[float], Any]

    def message(self, value: Any) -> str:
        return (
            f"{self.old} ({flag_name(self.old)}, {self.old_unit}) is deprecated: use "
            f"{self.new} ({flag_name(self.new)}, {_unit_of(self.new)}); "
            f"{value!r} {self.old_unit} is {self.convert(value)!r}"
        )


RENAMED = (
    Renamed("swap_space", "swap_memory", "GiB", lambda gib: int(gib * GIB)),
    Renamed("kv_offload_space", "kv_offload_size", "GiB", lambda gib: int(gib * GIB)),
    Renamed("max_prefill_ms_while_decoding", "max_prefill_time_while_decoding_s", "ms",
            lambda ms: ms / 1000),
)  # fmt: skip


def _unit_of(name: str) -> str:
    return EngineConfig.__dataclass_fields__[name].metadata["flag"].unit


def translate_renamed(given: Mapping[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """``given`` with every old spelling (``RENAMED``) replaced by its field, warning once
    for each; giving both spellings of one knob is a ``ValueError``."""
    values = dict(given)
    for renamed in RENAMED:
        if renamed.old not in values:
            continue
        old = values.pop(renamed.old)
        if renamed.new in values:
            raise ValueError(f"give {renamed.new} or {renamed.old} (deprecated), not both")
        warnings.warn(renamed.message(old), FutureWarning, stacklevel=stacklevel + 1)
        values[renamed.new] = renamed.convert(old)
    return values


def make_config(
    given: Mapping[str, Any], preset: Preset = NO_PRESET, *, stacklevel: int = 2
) -> EngineConfig:
    """The ``EngineConfig`` of the caller's ``given`` fields (old spellings accepted, with a
    warning ``stacklevel`` frames up) under ``preset``."""
    return EngineConfig(**preset.apply(translate_renamed(given, stacklevel + 1)))
