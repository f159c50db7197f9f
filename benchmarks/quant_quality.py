"""Quality of quantized weights and of the int8 KV cache on held-out text.

Texts pagedllm does not ship (``TEXTS``: licence texts under /usr/share/common-licenses,
Python standard-library sources, git's newest release notes), the first ``--tokens`` tokens
of each, teacher-forced through a runner (``pagedllm.worker.quality``: every position's full
logits against a reference's; top-1 agreement, mean KL(reference || test) per token and
perplexity of each, pooled over the texts). Two parts:

- ``weights``: each ``--models`` row is a GGUF served as stored (linears on quant_gemm's
  integer kernel, activations quantised per 32-block: to int8, or to int16 for Q8_0
  weights in a model all Q8_0 (``kernels/quant.py``'s ``int8_for_q8_0``);
  ``--q8-0-activations auto,int16,int8`` adds a row for each choice named)
  against the same file
  dequantised to float32 (``keep_quantized=False``), both in ``--dtype`` activations. The
  text goes in chunks of the integer kernel's row limit (``quant_gemm_int_rows``), so every
  linear runs the integer kernel, as decode steps do; longer prompt chunks run dequantised
  tiles, the float products of the reference's weights. A row is ``default`` (SmolLM2-135M,
  Q4_1 linears), ``qwen2.5-coder-0.5b`` (mostly Q5_0, Q8_0 / Q4_K / Q6_K tensors),
  ``gemma-3-270m`` (Q4_K_M), a ``.gguf`` path, or any of these with ``@Q8_0`` (or another
  format the ``gguf`` package quantizes: ``Q4_0``, ``Q4_1``, ``Q5_0``): every quantized
  tensor of its GGUF dequantised and quantized again in that format into a temporary file.
  A named model with ``:int8`` (or ``:q8_0``, ``:q4_0``) is its converted float directory
  quantized at load (``--quantization``: linears, embedding and head) against the same
  directory's float weights.
  A named model runs only when it is already fetched; a model whose linears are not kept
  quantized is skipped with the reason.
- ``kv``: the KV cache's formats on ``--kv-model``'s float weights, against float32 weights
  with a float32 cache: a bfloat16 cache, bfloat16 weights with a bfloat16 cache (the noise
  floor of bf16's own rounding), and each ``--kv-dtypes`` cache (each sequence's first block
  quantized, and kept unquantized) on float32 and on bfloat16 weights, the latter also
  against bfloat16 weights with a bfloat16 cache (the same activation dtype).

A table per part, then one JSON line.

    .venv/bin/python benchmarks/quant_quality.py
    .venv/bin/python benchmarks/quant_quality.py --parts kv --tokens 2048
    .venv/bin/python benchmarks/quant_quality.py --models default@Q8_0 --parts weights
    .venv/bin/python benchmarks/quant_quality.py --models default:int8,default:q4_0 --parts weights
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from pagedllm.attention.select import get_backend  # noqa: E402
from pagedllm.kernels.quant import Q8_0_ACTIVATIONS  # noqa: E402
from pagedllm.model.loader import LoadedModel, load_model, load_tokenizer  # noqa: E402
from pagedllm.worker.model_runner import TorchModelRunner, kv_cache_spec  # noqa: E402
from pagedllm.worker.quality import QualityReport, compare, text_logits  # noqa: E402

BLOCK_SIZE = 16
PARTS = ("weights", "kv")
LICENCES = Path("/usr/share/common-licenses")
GIT_NOTES = Path("/usr/share/doc/git/RelNotes")
NAMED_MODELS = ("default", "qwen2.5-coder-0.5b", "gemma-3-270m")
# quant_gemm's activations for Q8_0 weights (``--q8-0-activations``: a row each).
DEFAULT_Q8_0 = "auto"
# Positions compared at a time: a real model's [positions, vocabulary] log-softmaxes are
# large (Qwen's vocabulary is 151,936).
COMPARE_ROWS = 256
# Chunk of the float runners (the KV part, the references): the prompt path.
PROMPT_CHUNK = 256


# ---------------------------------------------------------------- texts


def _licence(name: str) -> Callable[[], str | None]:
    def read() -> str | None:
        path = LICENCES / name
        return path.read_text() if path.is_file() else None

    return read


def _module_source(name: str) -> Callable[[], str | None]:
    def read() -> str | None:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            return None
        return Path(spec.origin).read_text()

    return read


def _git_notes() -> str | None:
    """The release notes of git's newest feature release (x.y.0: a point release's notes
    are a few lines), in version order, not name order."""
    if not GIT_NOTES.is_dir():
        return None

    def version(path: Path) -> tuple[int, ...]:
        parts = path.stem.split(".")
        return tuple(int(p) for p in parts if p.isdigit())

    notes = sorted(GIT_NOTES.glob("*.*.0.txt"), key=version)
    return notes[-1].read_text() if notes else None


TEXTS: dict[str, Callable[[], str | None]] = {
    "GPL-3": _licence("GPL-3"),
    "Apache-2.0": _licence("Apache-2.0"),
    "MPL-2.0": _licence("MPL-2.0"),
    "argparse.py": _module_source("argparse"),
    "email/message.py": _module_source("email.message"),
    "asyncio/base_events.py": _module_source("asyncio.base_events"),
    "git RelNotes": _git_notes,
}


def held_out_texts(names: Sequence[str]) -> dict[str, str]:
    """The named texts this machine has (a missing one is left out with a note)."""
    unknown = [n for n in names if n not in TEXTS]
    if unknown:
        raise ValueError(f"unknown texts {unknown}; choose from {list(TEXTS)}")
    texts = {}
    for name in names:
        text = TEXTS[name]()
        if text is None:
            print(f"# text {name}: not on this machine, left out", file=sys.stderr)
        else:
            texts[name] = text
    if not texts:
        raise ValueError("none of the texts is on this machine")
    return texts


def tokenize(tokenizer, texts: dict[str, str], tokens: int) -> dict[str, list[int]]:
    """The first ``tokens`` tokens of each text; ``ValueError`` for a shorter text."""
    ids = {}
    for name, text in texts.items():
        encoded = tokenizer.encode(text)
        if len(encoded) < tokens:
            raise ValueError(f"{name} has {len(encoded)} tokens, fewer than --tokens {tokens}")
        ids[name] = encoded[:tokens]
    return ids


# ---------------------------------------------------------------- comparing


@dataclass(frozen=True, slots=True)
class Pooled:
    """Reports over several texts, weighted by their positions."""

    positions: int
    top1: float
    mean_kl: float
    ppl_reference: float
    ppl: float
    min_top1: float  # the worst text's agreement

    @classmethod
    def of(cls, reports: Sequence[QualityReport]) -> Pooled:
        n = sum(r.num_positions for r in reports)

        def mean(values: Sequence[float]) -> float:
            return sum(v * r.num_positions for v, r in zip(values, reports, strict=True)) / n

        return cls(
            n,
            mean([r.top1_agreement for r in reports]),
            mean([r.mean_kl for r in reports]),
            math.exp(mean([math.log(r.ppl_reference) for r in reports])),
            math.exp(mean([math.log(r.ppl) for r in reports])),
            min(r.top1_agreement for r in reports),
        )


def compare_text(reference: torch.Tensor, test: torch.Tensor, ids: Sequence[int]) -> QualityReport:
    """``compare`` over a text's positions, ``COMPARE_ROWS`` at a time, pooled."""
    pieces = [
        compare(reference[s : s + COMPARE_ROWS], test[s : s + COMPARE_ROWS], ids[s + 1 : s + 1 + COMPARE_ROWS])
        for s in range(0, reference.shape[0], COMPARE_ROWS)
    ]  # fmt: skip
    pooled = Pooled.of(pieces)
    return QualityReport(
        pooled.positions, pooled.mean_kl, pooled.top1, pooled.ppl_reference, pooled.ppl
    )


def runner(model: torch.nn.Module, tokens: int, kv: str = "auto", first: bool = False):
    """A runner whose cache holds ``tokens`` for each of the model's KV cache groups."""
    spec = kv_cache_spec(model, BLOCK_SIZE, kv, first)
    groups = max(spec.layer_groups, default=0) + 1
    return TorchModelRunner(
        model,
        block_size=BLOCK_SIZE,
        num_blocks=-(-tokens // BLOCK_SIZE) * groups,
        kv_cache_dtype=kv,
        unquantized_first_block=first,
        spec=spec,
    )


def report_row(per_text: dict[str, QualityReport]) -> dict:
    pooled = Pooled.of(list(per_text.values()))
    return {
        "positions": pooled.positions,
        "top1": pooled.top1,
        "min_top1": pooled.min_top1,
        "mean_kl": pooled.mean_kl,
        "ppl_reference": pooled.ppl_reference,
        "ppl": pooled.ppl,
        "texts": {
            name: {"top1": r.top1_agreement, "mean_kl": r.mean_kl, "ppl_reference": r.ppl_reference, "ppl": r.ppl}
            for name, r in per_text.items()
        },
    }  # fmt: skip


# ---------------------------------------------------------------- weights


def named_directory(name: str) -> Path:
    """A named model's directory in the cache (not fetched here)."""
    from pagedllm.model.default_model import default_model_dir
    from pagedllm.model.gemma_model import gemma_model_dir
    from pagedllm.model.qwen_coder_model import qwen_coder_model_dir

    return {
        "default": default_model_dir,
        "qwen2.5-coder-0.5b": qwen_coder_model_dir,
        "gemma-3-270m": gemma_model_dir,
    }[name]()


def source_gguf(source: str) -> Path:
    """The GGUF file of a row's source: a path, or the one a named model keeps beside its
    converted directory."""
    if source not in NAMED_MODELS:
        return Path(source)
    directory = named_directory(source)
    config = json.loads((directory / "config.json").read_text())
    return directory / config["pagedllm_converted_from"]


def requantize_gguf(source: Path, target: Path, kind: str) -> Path:
    """``source`` with every quantized tensor dequantised and quantized again as ``kind``
    (the ``gguf`` package's quantizer, numpy: a minute for a 135M model); float tensors
    and the metadata as they are."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[kind]
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        kind_of = field.types[0]
        sub = field.types[-1] if kind_of == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_of, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.tensor_type in floats:
            writer.add_tensor(tensor.name, tensor.data)
            continue
        values = dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@dataclass(frozen=True, slots=True)
class WeightRow:
    """A ``--models`` entry: ``source`` (a named model or a path), the format it is
    requantized to (None: as stored), or the ``--quantization`` scheme its float weights
    are quantized with at load (None: its GGUF)."""

    label: str
    source: str
    requantize: str | None
    scheme: str | None = None

    @classmethod
    def parse(cls, spec: str) -> WeightRow:
        rest, _, scheme = spec.partition(":")
        source, _, kind = rest.partition("@")
        return cls(spec, source, kind or None, scheme or None)


def skip_reason(row: WeightRow) -> str | None:
    """Why a row cannot run here (not fetched, no file), or None."""
    if row.source in NAMED_MODELS:
        if not (named_directory(row.source) / "config.json").is_file():
            return (
                f"{row.source} is not fetched (run `pagedllm generate --model {row.source}` once)"
            )
        return None
    path = Path(row.source)
    if path.suffix != ".gguf" or not path.is_file():
        return f"{row.source} is neither a named model ({', '.join(NAMED_MODELS)}) nor a .gguf file"
    return None


def kept_formats(model: torch.nn.Module) -> dict[str, int]:
    """How many linears (and embeddings) keep each quantized format."""
    counts: dict[str, int] = {}
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None:
            counts[quant.format] = counts.get(quant.format, 0) + 1
    return counts


def load_pair(
    row: WeightRow, dtype: str, workdir: Path, kinds: list[str]
) -> tuple[dict[str, LoadedModel], LoadedModel, object]:
    """({Q8_0 activations: served as stored} for each of ``kinds``, dequantised to float32
    weights, tokenizer) of a row; a ``scheme`` row: quantized at load, the float weights."""
    backend = get_backend("cpu")
    if row.scheme is not None:
        quantized = {
            kind: load_model(
                row.source,
                dtype,
                backend,
                load_tokenizer=False,
                quantization=row.scheme,
                q8_0_activations=kind,
            )
            for kind in kinds
        }
        reference = load_model(row.source, dtype, backend, keep_quantized=False)
        return quantized, reference, reference.tokenizer
    if row.requantize is None and row.source in NAMED_MODELS:
        quantized = {
            kind: load_model(
                row.source, dtype, backend, load_tokenizer=False, q8_0_activations=kind
            )
            for kind in kinds
        }
        reference = load_model(row.source, dtype, backend, keep_quantized=False)
        return quantized, reference, reference.tokenizer
    source = source_gguf(row.source)
    path = source
    if row.requantize is not None:
        path = requantize_gguf(
            source, workdir / f"{source.stem}.{row.requantize}.gguf", row.requantize
        )
    tokenizer = load_tokenizer(row.source if row.source in NAMED_MODELS else source)
    quantized = {
        kind: load_model(path, dtype, backend, load_tokenizer=False, q8_0_activations=kind)
        for kind in kinds
    }
    reference = load_model(path, dtype, backend, load_tokenizer=False, keep_quantized=False)
    return quantized, reference, tokenizer


def int_rows(dtype: str) -> int:
    """Rows up to which quant_gemm runs its integer kernel on int8 and on int16 activations
    alike (32 without the kernels: the reference path then runs either way). A row's
    products do not depend on the rows beside it, so the chunk changes no result."""
    from pagedllm.kernels.ops import layer_ops
    from pagedllm.quant_layout import CODES

    ops = layer_ops()
    if ops is None:
        return 32
    limits = [
        int(ops.quant_gemm_int_rows(getattr(torch, dtype), CODES[f])) for f in ("Q4_0", "Q8_0")
    ]
    return min(limit for limit in limits if limit > 0)


def measure_weights(args: argparse.Namespace, texts: dict[str, str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    chunk = args.chunk or int_rows(args.dtype)
    for spec in args.models:
        row = WeightRow.parse(spec)
        reason = skip_reason(row)
        if reason is not None:
            results[row.label] = {"skipped": reason}
            continue
        with tempfile.TemporaryDirectory(prefix="quant_quality_") as workdir:
            quantized, reference, tokenizer = load_pair(
                row, args.dtype, Path(workdir), args.q8_0_activations
            )
        formats = kept_formats(next(iter(quantized.values())).model)
        if not formats:
            results[row.label] = {
                "skipped": "its linears are not kept quantized (dequantised at load)"
            }
            continue
        per_text: dict[str, dict[str, QualityReport]] = {kind: {} for kind in args.q8_0_activations}
        for name, ids in tokenize(tokenizer, texts, args.tokens).items():
            ref = text_logits(runner(reference.model, args.tokens), ids, chunk=chunk)
            for kind, model in quantized.items():
                test = text_logits(runner(model.model, args.tokens), ids, chunk=chunk)
                per_text[kind][name] = compare_text(ref, test, ids)
                del test
            del ref
        for kind, reports in per_text.items():
            label = row.label if kind == DEFAULT_Q8_0 else f"{row.label} ({kind} activations)"
            results[label] = {**report_row(reports), "formats": formats, "chunk": chunk}
        del quantized, reference
        gc.collect()
    return results


# ---------------------------------------------------------------- KV cache


@dataclass(frozen=True, slots=True)
class KVCase:
    """A cache measured against a reference: the model's weights ``dtype``, the cache's
    ``kv`` and whether each sequence's first block stays unquantized."""

    label: str
    dtype: str
    kv: str
    first: bool
    reference: str  # "float32" (f32 weights, f32 cache) or "bfloat16" (bf16 weights and cache)


REFERENCE_LABELS = {"float32": "f32 weights, f32 KV", "bfloat16": "bf16 weights, bf16 KV"}


def kv_cases(kv_dtypes: Sequence[str]) -> list[KVCase]:
    cases = [
        KVCase("f32 weights, bf16 KV", "float32", "bfloat16", False, "float32"),
        KVCase("bf16 weights, bf16 KV", "bfloat16", "auto", False, "float32"),
    ]
    for kv in kv_dtypes:
        for first in (False, True):
            tail = " (block 0 full)" if first else ""
            cases.append(KVCase(f"f32 weights, {kv} KV{tail}", "float32", kv, first, "float32"))
            for ref in ("float32", "bfloat16"):
                cases.append(KVCase(f"bf16 weights, {kv} KV{tail}", "bfloat16", kv, first, ref))
    return cases


def measure_kv(args: argparse.Namespace, texts: dict[str, str]) -> dict[str, dict]:
    """Rows keyed ``"<case> vs <reference>"``. Both dtypes' models stay loaded and one
    text's logits at a time are kept (a [tokens, vocabulary] tensor per configuration)."""
    cases = kv_cases(args.kv_dtypes)
    models = {
        dtype: load_model(args.kv_model, dtype, get_backend("cpu"), keep_quantized=False)
        for dtype in ("float32", "bfloat16")
    }
    ids = tokenize(models["float32"].tokenizer, texts, args.tokens)
    configs = {(d, "auto", False) for d in models} | {(c.dtype, c.kv, c.first) for c in cases}
    per_case: dict[str, dict[str, QualityReport]] = {}
    for name, text_ids in ids.items():
        logits = {
            (dtype, kv, first): text_logits(
                runner(models[dtype].model, args.tokens, kv, first), text_ids, chunk=PROMPT_CHUNK
            )
            for dtype, kv, first in sorted(configs)
        }
        for case in cases:
            reference = logits[(case.reference, "auto", False)]
            test = logits[(case.dtype, case.kv, case.first)]
            label = f"{case.label} vs {REFERENCE_LABELS[case.reference]}"
            per_case.setdefault(label, {})[name] = compare_text(reference, test, text_ids)
        del logits
    return {label: report_row(per_text) for label, per_text in per_case.items()}


# ---------------------------------------------------------------- output


def print_table(title: str, rows: dict[str, dict], texts: Sequence[str]) -> None:
    print(f"\n{title}")
    short = [t.split("/")[-1][:12] for t in texts]
    print(
        f"{'':<52} {'top-1':>7} {'min':>7} {'KL':>9} {'ppl ref':>8} {'ppl':>8}  "
        + " ".join(f"{s:>12}" for s in short)
    )
    for label, row in rows.items():
        if "skipped" in row:
            print(f"{label:<52} skipped: {row['skipped']}")
            continue
        per = " ".join(
            f"{row['texts'][t]['top1']:>12.4f}" if t in row["texts"] else f"{'-':>12}"
            for t in texts
        )
        print(
            f"{label:<52} {row['top1']:>7.4f} {row['min_top1']:>7.4f} {row['mean_kl']:>9.2e} "
            f"{row['ppl_reference']:>8.3f} {row['ppl']:>8.3f}  {per}"
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--models", default="default,default@Q8_0,qwen2.5-coder-0.5b,gemma-3-270m")
    parser.add_argument("--dtype", default="float32", help="weights part: activations' dtype")
    parser.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="weights part: rows a step (0: the integer kernel's limit)",
    )
    parser.add_argument(
        "--q8-0-activations",
        default=DEFAULT_Q8_0,
        help="weights part: Q8_0 weights' activations, auto, int16 and/or int8 (a row each)",
    )
    parser.add_argument(
        "--kv-model", default="default", help="kv part: a model whose float weights are used"
    )
    parser.add_argument("--kv-dtypes", default="int8")
    parser.add_argument("--texts", default=",".join(TEXTS))
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of each text")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    args.models = [m for m in args.models.split(",") if m]
    args.kv_dtypes = [k for k in args.kv_dtypes.split(",") if k]
    args.q8_0_activations = [k for k in args.q8_0_activations.split(",") if k]
    if not args.q8_0_activations or set(args.q8_0_activations) - set(Q8_0_ACTIVATIONS):
        parser.error(f"--q8-0-activations: choose from {Q8_0_ACTIVATIONS}")
    torch.set_num_threads(args.threads)
    texts = held_out_texts([t for t in args.texts.split(",") if t])
    results: dict = {"tokens": args.tokens, "texts": list(texts), "threads": args.threads}
    if "weights" in parts:
        results["weights"] = {"dtype": args.dtype, "rows": measure_weights(args, texts)}
        print_table(
            f"weights served as stored vs dequantised to float32 ({args.dtype} activations)",
            results["weights"]["rows"],
            list(texts),
        )
    if "kv" in parts:
        results["kv"] = {"model": args.kv_model, "rows": measure_kv(args, texts)}
        print_table(f"KV cache formats ({args.kv_model})", results["kv"]["rows"], list(texts))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
