"""Load a model (the families of ``model/config.py``): a local Hugging Face directory, a ``.gguf`` file, or "default".

::

    load_model("path/to/hf_dir")        config.json + *.safetensors (single, or sharded
                                         with model.safetensors.index.json) + tokenizer
    load_model("path/to/model.gguf")    linears in GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K /
                                         Q5_K / Q6_K kept as stored (kernels/quant.py), the
                                         rest dequantised through the ``gguf`` package
    load_model("default")               SmolLM2-135M-Instruct, converted once (default_model.py);
                                         on the CPU its GGUF's linears run as stored (the
                                         converted directory gives the tokenizer; so for
                                         "qwen2.5-coder-0.5b"), keep_quantized=False: the
                                         converted float weights
    load_model(..., quantization="int8")  the float linears, embedding and head quantized at load
                                         (model/quantize.py)

Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.kernels.probe import CpuInfo, cpu_info
from pagedllm.kernels.quant import QuantWeight, with_q8_0_activations
from pagedllm.model.config import ModelConfig
from pagedllm.model.hf_tokenizer import CONVERTED_FROM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.util.memory import release_freed_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MODEL_NAME = "default"
GEMMA_MODEL_NAME = "gemma-3-270m"  # opt-in: model/gemma_model.py
QWEN_CODER_MODEL_NAME = "qwen2.5-coder-0.5b"  # opt-in: model/qwen_coder_model.py


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model, its validated config, its tokenizer and a display name."""

    model: torch.nn.Module  # LlamaForCausalLM or DecoderForCausalLM
    config: ModelConfig
    tokenizer: Any
    name: str
    dtype_reason: str = ""  # why the model runs in its dtype (see choose_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the model holds (``held_weight_bytes``): quantized ones at
        their stored size, packed copies included."""
        from pagedllm.model.weights import held_weight_bytes

        return held_weight_bytes(self.model)


def load_model(
    model: str | Path = DEFAULT_MODEL_NAME,
    dtype: str | torch.dtype = "auto",
    backend: AttentionBackend | None = None,
    *,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    keep_quantized: bool = True,
    quantization: str | None = None,
    q8_0_activations: str = "auto",
) -> LoadedModel:
    """Load weights, config and tokenizer. ``ValueError`` for anything unsupported.

    ``dtype``: "float32", "bfloat16", "float16" or "auto" (``choose_dtype``: bfloat16 for a
    float32 checkpoint on a CPU with bf16 dot products, else the config's ``torch_dtype``). ``backend``: the attention backend (default: the fastest available, ``get_backend("auto")``).
    ``keep_quantized``: a GGUF's linears stored in a format of ``kernels/quant.py`` run as
    stored on the CPU (their only copy), a named model's too (its GGUF, kept beside the
    converted directory); False dequantises every tensor to ``dtype``.
    ``quantization`` ("int8", "q8_0", "q4_0"; ``model/quantize.py``): the float layer linears,
    embedding and LM head quantized as they load (a named model's from its converted float weights), the CPU only.
    ``q8_0_activations`` ("auto", "int16", "int8"): what Q8_0 weights' activations are
    quantised to (``kernels/quant.py``'s ``int8_for_q8_0``: "auto" gives int8 where the
    model keeps other weights at fewer bits, int16 in a model all Q8_0).
    """
    if quantization is not None:
        check_quantization(quantization, torch.device(device), keep_quantized)
    keep = keep_quantized and torch.device(device).type == "cpu"
    named = named_model(str(model))
    if named is not None:
        path, name = named
    else:
        path = Path(model).expanduser()
        name = path.stem if path.suffix == ".gguf" else path.name
    gguf = _kept_gguf(path) if named is not None and keep and quantization is None else None
    if gguf is not None:
        from pagedllm.model.gguf_loader import read_gguf

        raw_config, weights, _ = read_gguf(gguf, keep_quantized=True, layout_cache=layout_cache())
        tokenizer_loader = _hf_tokenizer_loader(path)
    elif path.suffix == ".gguf" and path.is_file():
        from pagedllm.model.gguf_loader import read_gguf

        raw_config, weights, tokenizer_loader = read_gguf(
            path, keep_quantized=keep, tokenizer_cache=tokenizer_cache()
        )
    elif path.is_dir():
        raw_config = _read_config(path)
        weights = iter_safetensors(path)
        tokenizer_loader = _hf_tokenizer_loader(path)
    else:
        raise ValueError(f"model {str(model)!r} is neither a directory nor a .gguf file")
    config = ModelConfig.from_dict(raw_config)
    if quantization is not None:
        from pagedllm.model.quantize import check_family, quantized_weights

        check_family(quantization, raw_config.get("model_type", ""))
        weights = quantized_weights(weights, quantization, config.tie_word_embeddings)
    weights = with_q8_0_activations(weights, q8_0_activations)
    torch_dtype, reason = choose_dtype(dtype, config, torch.device(device))
    module = build_model(config, weights, torch_dtype, backend, torch.device(device))
    tokenizer = tokenizer_loader() if load_tokenizer else None
    return LoadedModel(module, config, tokenizer, name, dtype_reason=reason)


def check_quantization(quantization: str, device: torch.device, keep_quantized: bool) -> None:
    """``ValueError`` naming the field where ``quantization`` cannot be served."""
    from pagedllm.model.quantize import scheme_format

    scheme_format(quantization)
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU's integer kernels, not on {device}"
        )
    if not keep_quantized:
        raise ValueError("quantization needs keep_quantized=True (weights kept quantized)")


def load_tokenizer(model: str | Path = DEFAULT_MODEL_NAME) -> Any:
    """The tokenizer of a model directory, a ``.gguf`` file or ``"default"``, without its
    weights (the router hashes prompts with it)."""
    named = named_model(str(model))
    if named is not None:
        return _hf_tokenizer_loader(named[0])()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from pagedllm.model.gguf_loader import read_gguf

        return read_gguf(path, tokenizer_cache=tokenizer_cache())[2]()
    if path.is_dir():
        return _hf_tokenizer_loader(path)()
    raise ValueError(f"model {str(model)!r} is neither a directory nor a .gguf file")


def choose_dtype(
    dtype: str | torch.dtype,
    config: ModelConfig,
    device: torch.device,
    cpu: CpuInfo | None = None,
) -> tuple[torch.dtype, str]:
    """The dtype to run in and why. "auto" follows the checkpoint's ``torch_dtype`` (float32
    when absent), except that a float32 checkpoint runs in bfloat16 on a CPU with bf16 dot
    products (AVX-512-bf16 or AMX), where bf16 linears and attention are several times
    faster; ``--dtype float32`` keeps float32. ``cpu``: this machine's unless given."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype, "asked for"
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
        return DTYPES[dtype], f"asked for (--dtype {dtype})"
    stored = config.torch_dtype or "float32"
    if stored not in DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {stored!r}; use --dtype {'/'.join(DTYPES)}")
    if stored != "float32" or device.type != "cpu":
        return DTYPES[stored], f"auto: the checkpoint's dtype ({stored})"
    cpu = cpu or cpu_info()
    if cpu.bf16_dot:
        dots = "amx_bf16" if cpu.amx else "avx512_bf16"
        return torch.bfloat16, (
            f"auto: float32 checkpoint, and this CPU has bf16 dot products ({dots}); "
            "--dtype float32 keeps float32"
        )
    return torch.float32, "auto: float32 checkpoint, and this CPU has no bf16 dot products"


def build_model(
    config: ModelConfig,
    weights: Iterator[tuple[str, torch.Tensor | QuantWeight]],
    dtype: torch.dtype,
    backend: AttentionBackend | None = None,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """Allocate the model without initialising it, then load the weights in (a
    ``QuantWeight`` as it is: its linear keeps it instead of a float weight)."""
    if backend is None:
        from pagedllm.attention.select import get_backend

        backend = get_backend("auto")
    with torch.device("meta"):
        model = new_model(config, backend)
    model = empty_on(model.to(dtype=dtype), torch.device(device))
    model.load_weights(
        (name, tensor if isinstance(tensor, QuantWeight) else tensor.to(dtype))
        for name, tensor in weights
    )
    release_freed_memory()
    return model.eval().requires_grad_(False)


def empty_on(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)`` through ``torch.empty``: ``to_empty``'s
    ``empty_like`` of a meta tensor runs torch's Python reference, which imports
    sympy (35 MiB resident) for a shape check."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def new_model(config: ModelConfig, backend: AttentionBackend) -> torch.nn.Module:
    """The decoder that runs ``config``: the Llama family's (with its CPU fast path) or the
    general one (Gemma, mixtures of experts, latent attention)."""
    if config.uses_llama_decoder:
        from pagedllm.model.fast_path import CpuFastPath

        return LlamaForCausalLM(config, backend, fast_path_builder=CpuFastPath.build)
    from pagedllm.model.decoder import DecoderForCausalLM
    from pagedllm.model.gemma_fast_path import GemmaFastPath

    return DecoderForCausalLM(config, backend, fast_path_builder=GemmaFastPath.build)


def layout_cache() -> Path:
    """Where a named model's GGUF weights, once repacked for the kernels, are kept
    (``layout_cache.py``; a GGUF given by path is repacked at each load)."""
    from pagedllm.model.default_model import cache_dir

    return cache_dir() / "layouts"


def tokenizer_cache() -> Path:
    """Where tokenizers rebuilt from GGUF files are kept (``gguf_tokenizer``)."""
    from pagedllm.model.default_model import cache_dir

    return cache_dir() / "tokenizers"


def _kept_gguf(path: Path) -> Path | None:
    """The GGUF a named model's directory keeps beside its converted weights (the one it
    was converted from), where its family runs quantized linears; else None."""
    config = _read_config(path)
    source = config.get(CONVERTED_FROM)
    if source is None or config.get("model_type") not in ("llama", "qwen2", "qwen3", "gemma3_text"):
        return None
    gguf = path / source
    return gguf if gguf.is_file() else None


def named_model(model: str) -> tuple[Path, str] | None:
    """(directory, display name) of a model pagedllm fetches and converts by name, on
    first use: "default" (SmolLM2), "gemma-3-270m" or "qwen2.5-coder-0.5b"; None for any other string."""
    if model == DEFAULT_MODEL_NAME:
        from pagedllm.model.default_model import ensure_default_model

        return ensure_default_model(), "SmolLM2-135M-Instruct"
    if model == GEMMA_MODEL_NAME:
        from pagedllm.model.gemma_model import ensure_gemma_model

        return ensure_gemma_model(), GEMMA_MODEL_NAME
    if model == QWEN_CODER_MODEL_NAME:
        from pagedllm.model.qwen_coder_model import ensure_qwen_coder_model

        return ensure_qwen_coder_model(), QWEN_CODER_MODEL_NAME
    return None


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory, one file at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def safetensors_files(path: Path) -> list[Path]:
    """The shards named by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path} (only safetensors checkpoints are supported)")
    return files


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} has no config.json")
    return json.loads(file.read_text())


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _hf_tokenizer_loader(path: Path):
    def load() -> Any:
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); to serve "
                "token ids only, pass skip_tokenizer_init=True / --skip-tokenizer-init"
            )
        from pagedllm.model.hf_tokenizer import load_hf_tokenizer

        try:
            return load_hf_tokenizer(str(path))
        except (ImportError, OSError, ValueError) as error:
            raise ValueError(
                f"the tokenizer of {path} cannot be loaded ({error}); to serve token ids "
                "only, pass skip_tokenizer_init=True / --skip-tokenizer-init"
            ) from error

    return load
