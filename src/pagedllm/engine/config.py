"""``EngineConfig``: every knob of an engine, validated once, frozen."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.scheduler import PREEMPTION_MODES
from pagedllm.kv_dtypes import UNQUANTIZED_FIRST_BLOCK_DTYPES, check_kv_cache_dtype, is_quantized

GIB = 1 << 30
# Without --kv-cache-memory or --memory-fraction: enough for a few long sessions of
# a small model, and never a surprise on a machine shared with other work.
DEFAULT_KV_CACHE_MEMORY = 1 * GIB
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_KV_OFFLOAD_SPACE_GIB = 16.0
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The names pagedllm.attention.select.get_backend accepts (kept here so config stays torch-free).
ATTENTION_BACKENDS = ("auto", "cpu", "reference")
# How tensor-parallel ranks gather activations: "shm" through shared memory (ranks on one
# CPU machine), "gloo" (NCCL on CUDA) through torch.distributed; "auto" picks shm where
# it can run.
TP_COLLECTIVES = ("auto", "shm", "gloo")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build and run one engine (names as in vLLM where it has them).

    ``kv_cache_memory`` (bytes) or ``memory_fraction`` (of free memory) sizes the
    device tier; ``num_blocks`` overrides both (tests). ``swap_space`` is the host
    tier in GiB (0 disables preemption by swap). ``max_model_len=None`` takes the
    model's limit, capped to what the cache holds; ``max_num_batched_tokens=None``
    means 2048 with chunked prefill, else ``max_model_len``. ``kv_offload_dir`` turns
    on the disk tier under the prefix cache (a directory of its own, kept across
    restarts), holding at most ``kv_offload_space`` GiB.
    """

    model: str = "default"
    dtype: str = "auto"
    # The KV cache's storage format (pagedllm.kv_dtypes): "auto" (the model's dtype),
    # "float32", "bfloat16", "float16", "int8", "int4", "fp8_e4m3", "fp8_e5m2".
    kv_cache_dtype: str = "auto"
    # A quantized cache keeps each sequence's first block (logical block 0, the attention
    # sink) in the model's dtype; None: on for int4, off for the other formats.
    kv_cache_unquantized_first_block: bool | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    memory_fraction: float | None = None
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Most prompt tokens in a step that also decodes (None: max_num_batched_tokens); see
    # core.scheduler.SchedulerConfig.
    max_prefill_tokens_while_decoding: int | None = None
    # Or in time: the engine keeps the cap at about this many milliseconds of prompt work,
    # from the steps it measures (engine/prefill_slice.py; max_prefill_tokens_while_decoding,
    # if given too, is the cap until the first prompt step has been timed, and the most the
    # engine picks).
    max_prefill_ms_while_decoding: float | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Requests arriving together share a prefix in flight: one computes it, the others
    # wait a step for its blocks (see core/scheduler.py).
    enable_inflight_sharing: bool = True
    # A waiting request pins its cached prefix until it is admitted (core/scheduler.py):
    # what a router predicted from the replica's cache is still there when it runs.
    pin_waiting_prefixes: bool = True
    preemption_mode: str = "auto"
    swap_space: float = 0.0
    num_host_blocks: int | None = None
    watermark: float = 0.01
    seed: int = 0
    attention_backend: str = "auto"
    device: str = "cpu"
    # torch intra-op threads for the model step; None keeps torch's default (one per core).
    num_threads: int | None = None
    # Greedy decode steps per schedule (multi-step decoding; 1: schedule every step).
    num_scheduler_steps: int = 1
    kv_offload_dir: str | None = None
    kv_offload_space: float = DEFAULT_KV_OFFLOAD_SPACE_GIB
    # Load no tokenizer: prompts are token ids, outputs token ids (text stays empty).
    skip_tokenizer_init: bool = False
    # The elastic pool's automatic mode (``--kv-cache-memory MIN:MAX``): kv_cache_memory
    # is MIN (the start), this is MAX; the pool shrinks toward MIN after elastic_idle_s.
    kv_cache_memory_max: int | None = None
    elastic_idle_s: float = 30.0
    # A shrink's compaction takes at most this share of a step's time, per step.
    compaction_step_fraction: float = 0.15
    # Tensor parallelism (engine/distributed.py): ranks, and torchrun-style rendezvous
    # across machines (master_port None on one machine: a free port is picked).
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout_s: float = 300.0
    tp_collective: str = "auto"

    def __post_init__(self) -> None:
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
        ms = self.max_prefill_ms_while_decoding
        if ms is not None and (
            isinstance(ms, bool) or not isinstance(ms, int | float) or not ms > 0
        ):
            raise ValueError(f"max_prefill_ms_while_decoding must be positive, got {ms!r}")
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
        if not self.kv_offload_space > 0:
            raise ValueError(
                f"kv_offload_space must be positive (GiB), got {self.kv_offload_space!r}"
            )
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir:
                raise ValueError(f"kv_offload_dir must be a path, got {self.kv_offload_dir!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_dir needs prefix caching (enable_prefix_caching)")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative (GiB), got {self.swap_space}")
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
        self._check_distributed()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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
