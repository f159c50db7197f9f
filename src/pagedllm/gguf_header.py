"""A GGUF file's header (metadata and tensor table) in plain Python, and the weight bytes
the engine holds for it.

Plain Python (``struct`` over an ``mmap``; no numpy, no torch), so that ``pagedllm plan``
reads a file's shapes and types without loading anything; ``model/gguf_index.py`` maps the
tensors' data from the same header. Which tensors the loader keeps as stored (``kept``)
is decided here too, so that the plan counts what the engine will hold
(``held_weight_bytes``).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.quant_layout import FORMATS, row_bytes

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGML type number -> (name, weights per block, bytes per block), as the ``gguf`` package's
# GGML_QUANT_SIZES (a test holds the two equal).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# Metadata value types: struct format of the scalars.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# The architectures whose decoders run quantized linears, and the tensors kept as stored
# there (GGUF names: the linears', the token embedding, the untied head).
QUANTIZED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_KEPT_LAYER_TENSORS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
_KEPT_GLOBAL = ("token_embd.weight", "output.weight")
# Tensors the loader fuses into one linear (q/k/v, gate/up): kept only together.
_FUSED = {
    "attn_q": "qkv",
    "attn_k": "qkv",
    "attn_v": "qkv",
    "ffn_gate": "gate_up",
    "ffn_up": "gate_up",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the table: name, dims (fastest first, as GGUF lists them), GGML type
    number and offset of its data from the data section's start."""

    name: str
    dims: tuple[int, ...]
    type_code: int
    offset: int

    @property
    def type_name(self) -> str:
        return ggml_type(self.type_code)[0]

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor as stored in the file."""
        _, block, size = ggml_type(self.type_code)
        return self.numel // block * size


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """The metadata (key -> int, float, bool, str or list), the tensor table and where the
    tensors' data starts in the file."""

    fields: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))


def ggml_type(code: int) -> tuple[str, int, int]:
    """(name, weights per block, bytes per block) of a GGML type number."""
    if code not in GGML_TYPES:
        raise ValueError(f"GGUF: unknown tensor type {code}")
    return GGML_TYPES[code]


class _Cursor:
    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.offset = 0

    def read(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.read("Q")
        text = bytes(self.buffer[self.offset : self.offset + size]).decode("utf-8", "replace")
        self.offset += size
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.read(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"GGUF: unknown metadata value type {kind}")
        item, count = self.read("I"), self.read("Q")
        if item in _SCALARS:  # a numeric array in one read
            fmt = _SCALARS[item]
            values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
            self.offset += count * struct.calcsize(fmt)
            return list(values)
        return [self.value(item) for _ in range(count)]


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (the data is not read); ``ValueError`` for
    a file that is not GGUF version 2 or 3, or is cut short."""
    with open(path, "rb") as file:
        if Path(path).stat().st_size < 24:
            raise ValueError(f"{path} is not a GGUF file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            try:
                return parse_header(mapped, str(path))
            except struct.error as error:
                raise ValueError(f"{path}: GGUF header cut short ({error})") from error


def parse_header(buffer: Any, name: str = "GGUF") -> GGUFHeader:
    """``read_header`` of a buffer (bytes, mmap, memoryview) holding the file."""
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != MAGIC:
        raise ValueError(f"{name} is not a GGUF file")
    cursor.offset = 4
    version = cursor.read("I")
    if version not in (2, 3):
        raise ValueError(f"{name}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cursor.read("Q"), cursor.read("Q")
    fields = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.read("I"))
    tensors = []
    for _ in range(num_tensors):
        tensor_name = cursor.string()
        dims = tuple(cursor.read("Q") for _ in range(cursor.read("I")))
        tensors.append(TensorInfo(tensor_name, dims, cursor.read("I"), cursor.read("Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    return GGUFHeader(fields, tensors, -(-cursor.offset // alignment) * alignment)


def kept(architecture: str, name: str, type_name: str) -> bool:
    """Whether the loader keeps the tensor ``name`` of GGML type ``type_name`` as stored, on
    its own (q/k/v and gate/up are then kept together or not at all: ``held_weight_bytes``)."""
    if architecture not in QUANTIZED_ARCHITECTURES or type_name not in FORMATS:
        return False
    if name in _KEPT_GLOBAL:
        return True
    parts = name.split(".")
    return (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[2] in _KEPT_LAYER_TENSORS
        and parts[3] == "weight"
    )


def held_weight_bytes(header: GGUFHeader, float_bytes: float) -> int:
    """The weight bytes the engine holds for this file (``model/weights.py``'s
    ``held_weight_bytes`` of the loaded model): tensors kept as stored at their size in the
    kernels' layout (a q/k/v or gate/up whose parts are all kept: each part in its own
    format, fused or apart, ``fused_format``; only some of them kept: all dequantised),
    every other tensor dequantised at ``float_bytes`` a weight. Float linears' packed copies
    are not counted."""
    groups: dict[tuple[str, str], list[TensorInfo]] = {}
    total = 0.0
    for tensor in header.tensors:
        if not kept(header.architecture, tensor.name, tensor.type_name):
            total += tensor.numel * float_bytes
            continue
        parts = tensor.name.split(".")
        fused = _FUSED.get(parts[2]) if len(parts) == 4 else None
        groups.setdefault((parts[1], fused) if fused else (tensor.name, ""), []).append(tensor)
    for (_, fused), members in groups.items():
        whole = len(members) == (3 if fused == "qkv" else 2 if fused else 1)
        for tensor in members:
            width, rows = tensor.dims[0], tensor.numel // tensor.dims[0]
            if whole:
                total += rows * row_bytes(tensor.type_name, width)
            else:
                total += tensor.numel * float_bytes
    return int(total)


def gguf_config(fields: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A ``config.json``-style dict from a GGUF file's metadata (``fields``) and tensor
    ``names``; ``ValueError`` for what the engine cannot run."""
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    present = set(names)
    if "rope_freqs.weight" in present:
        raise ValueError("unsupported GGUF rope scaling (rope_freqs.weight, as in Llama 3.1)")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}")
    num_heads = int(fields.get(f"{arch}.attention.head_count"))
    hidden_size = int(fields.get(f"{arch}.embedding_length"))
    tokens = fields.get("tokenizer.ggml.tokens", [])
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(fields.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden_size,
        "intermediate_size": int(fields.get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.get(f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length")),
        "rms_norm_eps": float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in present,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config.update(_gemma3_config(fields, tokens))
    return {k: v for k, v in config.items() if v is not None}


def _gemma3_config(fields: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """Gemma 3's keys: what the file says; the rest (local rope base, layer pattern,
    query_pre_attn_scalar) are transformers' defaults, as its own GGUF loader leaves them.
    A chat turn ends with <end_of_turn>, a stop token besides <eos>."""
    eos = [int(fields.get("tokenizer.ggml.eos_token_id"))]
    if "<end_of_turn>" in tokens:
        eos.append(tokens.index("<end_of_turn>"))
    return {
        "model_type": "gemma3_text",
        "sliding_window": fields.get("gemma3.attention.sliding_window"),
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "eos_token_id": eos,
    }
