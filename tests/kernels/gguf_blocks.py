"""GGUF blocks of float weights in every format the kernels keep as stored.

The ``gguf`` package quantises Q8_0, Q4_0, Q4_1 and Q5_0 but only dequantises the K-quants;
``quantize`` here makes valid Q4_K / Q5_K / Q6_K super-blocks too (a plain min/max fit, not
llama.cpp's search): the tests need blocks whose values resemble a weight's, and the
``gguf`` package's dequantisers stay the reference of what the blocks mean.
"""

from __future__ import annotations

import numpy as np

QK = 256


def quantize(array: np.ndarray, format: str) -> np.ndarray:
    """GGUF blocks (uint8 [rows, bytes]) of ``array`` [rows, width] in ``format``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if format in ("Q4_K", "Q5_K"):
        return _q45_k(array.astype(np.float32), bits=4 if format == "Q4_K" else 5)
    if format == "Q6_K":
        return _q6_k(array.astype(np.float32))
    return gguf_quantize(array.astype(np.float32), GGMLQuantizationType[format])


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _q45_k(array: np.ndarray, bits: int) -> np.ndarray:
    rows, width = array.shape
    w = array.reshape(rows, width // QK, 8, 32)
    low = np.minimum(w.min(axis=-1), 0.0)
    levels = (1 << bits) - 1
    scale = (w.max(axis=-1) - low) / levels
    d = scale.max(axis=-1) / 63
    dmin = (-low).max(axis=-1) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = _round_to(scale, d16.astype(np.float32)[..., None], 63)
    mn = _round_to(-low, dmin16.astype(np.float32)[..., None], 63)
    step = (d16.astype(np.float32)[..., None] * sc)[..., None]
    offset = (dmin16.astype(np.float32)[..., None] * mn)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((w + offset) / step), 0)
    q = np.clip(q, 0, levels).astype(np.uint8)  # [rows, S, 8, 32]
    packed = np.empty((rows, width // QK, 12), np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    nibbles = (q[:, :, 0::2] & 0x0F) | ((q[:, :, 1::2] & 0x0F) << 4)  # run i: blocks 2i, 2i+1
    parts = [_f16(d), _f16(dmin), packed]
    if bits == 5:
        high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]  # bit j: block j
        parts.append(np.bitwise_or.reduce(high, axis=2))
    parts.append(nibbles.reshape(rows, width // QK, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _q6_k(array: np.ndarray) -> np.ndarray:
    rows, width = array.shape
    w = array.reshape(rows, width // QK, 16, 16)
    scale = np.abs(w).max(axis=-1) / 31
    d16 = (scale.max(axis=-1) / 127).astype(np.float16)
    sc = _round_to(scale, d16.astype(np.float32)[..., None], 127).astype(np.int8)
    step = (d16.astype(np.float32)[..., None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.rint(w / step), 0) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(rows, width // QK, 2, 4, 32)
    # half h, block s: ql[64h + 32 (s & 1) + e] nibble s >> 1; qh[32h + e] bits 2s, 2s + 1
    ql = (q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=3)
    parts = [
        ql.reshape(rows, width // QK, 128),
        qh.reshape(rows, width // QK, 64),
        sc.view(np.uint8),
        _f16(d16),
    ]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _round_to(values: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(step > 0, values / step, 0)
    return np.clip(np.rint(ratio), 0, top).astype(np.uint8)
