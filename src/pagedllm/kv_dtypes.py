"""The KV cache's storage formats: names and the bytes each costs (pure Python).

The engine config, the planner and the worker all read this one table, so the start-up
report, ``pagedllm plan`` and the tensors the worker allocates agree to the byte.

Per token, per layer and KV head, for head_dim ``D`` and block size ``B`` (K and V)::

    auto                 the model's dtype
    float32              2 x 4 D
    bfloat16, float16    2 x 2 D
    int8                 2 x (D + 2)        one int8 per element, one fp16 scale per token
    int4                 K: D/2 + 4 D / B   4 bits per element; fp16 scale + minimum per
                                            channel, over the block's B tokens (K's outliers
                                            sit in channels)
                         V: D/2 + 4 D / G   fp16 scale + minimum per token for each group of
                                            G = 32 channels (G = D when 32 does not divide D)
    fp8_e4m3, fp8_e5m2   2 x D              8-bit floats, no scale (vLLM's default scale 1)

The quantized formats quantize a block when it fills ("seal"): the open block of each
sequence stays in the model's dtype in a staging block outside the pool until then. With
``kv_cache_unquantized_first_block`` (the default for the formats in
``UNQUANTIZED_FIRST_BLOCK_DTYPES``), each sequence's first block is never sealed: one more
staging block a sequence, and per cached-free first block (at most ``max_num_seqs``).
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4", "fp8_e4m3", "fp8_e5m2")
QUANTIZED_KV_DTYPES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")
# Formats that keep each sequence's first block unquantized unless told otherwise
# (docs/performance.md: half of int4's divergence comes from the first 16 tokens).
UNQUANTIZED_FIRST_BLOCK_DTYPES = ("int4",)
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Scales and minimums are stored as float16.
SCALE_BYTES = 2
# int4 V: channels per scale (attention/quant.py reads it from here).
INT4_V_GROUP = 32


def check_kv_cache_dtype(name: object) -> str:
    """``name`` if it is a known KV cache dtype, else ``ValueError``."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return name


def is_quantized(name: str) -> bool:
    return check_kv_cache_dtype(name) in QUANTIZED_KV_DTYPES


def resolve_kv_cache_dtype(name: str, model_dtype: str) -> str:
    """``auto`` becomes the model's dtype (``float32``, ``bfloat16`` or ``float16``)."""
    check_kv_cache_dtype(name)
    if name != "auto":
        return name
    if model_dtype not in FLOAT_BYTES:
        raise ValueError(f"model dtype must be one of {tuple(FLOAT_BYTES)}, got {model_dtype!r}")
    return model_dtype


def head_block_bytes(name: str, head_dim: int, block_size: int) -> int:
    """Bytes of K and V of one block, one layer, one KV head (scales included)."""
    name = check_kv_cache_dtype(name)
    if name == "auto":
        raise ValueError("resolve 'auto' to the model's dtype first (resolve_kv_cache_dtype)")
    if head_dim < 1 or block_size < 1:
        raise ValueError("head_dim and block_size must be positive")
    if name in FLOAT_BYTES:
        return 2 * block_size * head_dim * FLOAT_BYTES[name]
    if name == "int8":
        return 2 * block_size * (head_dim + SCALE_BYTES)
    if name == "int4":
        if head_dim % 2:
            raise ValueError(f"int4 packs two values a byte: head_dim must be even, got {head_dim}")
        packed = block_size * head_dim // 2
        groups = head_dim // INT4_V_GROUP if head_dim % INT4_V_GROUP == 0 else 1
        k_bytes = packed + 2 * SCALE_BYTES * head_dim  # scale + minimum per channel
        v_bytes = packed + 2 * SCALE_BYTES * block_size * groups  # per token and group
        return k_bytes + v_bytes
    return 2 * block_size * head_dim  # fp8


def kv_bytes_per_block(
    name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int
) -> int:
    """Bytes one block of ``block_size`` tokens costs in the pool, every layer, K and V."""
    return num_layers * num_kv_heads * head_block_bytes(name, head_dim, block_size)


def kv_element_bytes(name: str, head_dim: int, block_size: int) -> float:
    """Average bytes per cached K or V element, scales included (1.03125 for int8 at
    head_dim 64): what the planner's per-element arithmetic takes."""
    return head_block_bytes(name, head_dim, block_size) / (2 * block_size * head_dim)
