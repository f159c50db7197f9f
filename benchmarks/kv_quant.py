"""A quantized KV cache, per ``kv_cache_dtype``: quality, capacity, attention speed, serving.

For each dtype (``--kv-dtypes``, against the model dtype's own cache):

- **quality**: the fixed public-domain text ``benchmarks/data/public_domain.txt`` cut into
  ``--texts`` prompts of ``--text-tokens`` tokens, each sent once with
  ``SamplingParams(prompt_logprobs=K, max_tokens=1)`` through the public ``LLM`` API (the same
  numbers ``/v1/completions`` returns with ``echo`` and ``logprobs``). Per position: the
  prompt token's log-probability (perplexity, ΔPPL against the model dtype's cache), the
  most likely token (top-1 agreement) and the top ``K`` (mean KL(model dtype || dtype) over the
  top-K tokens both return plus one bucket for the rest of the vocabulary: a lower bound of
  the full KL that approaches it as K grows; the quality gate in the tests uses full logits).
  ``--first-block both`` measures each dtype with its first block (logical block 0, the
  attention sink) unquantized and quantized (``kv_cache_unquantized_first_block``; by default
  the engine's choice); ``--full-logits`` adds the full-logit KL, top-1 and ΔPPL of the same
  texts teacher-forced through the runner (``pagedllm.worker.quality``).
- **capacity**: bytes per token (scales included) and blocks for ``--kv-cache-memory``.
- **decode attention**: one decode step through every layer's ``CpuAttention.forward``
  (the step's K/V write included; ``--attention-layers`` of them where memory is short) over
  contexts of 2k and 8k tokens on shuffled blocks, the model's attention shape, queries in
  ``--attention-dtype``; full-precision caches of each ``--plain-kv-dtypes`` (the plain
  kernel) against the quantized ones (``quant_attention``); medians of ``--rounds`` rounds,
  the dtypes taking turns, and each dtype's time over bf16's in the same round (median and
  range of those ratios).
- **serving**: the standard workload (64 requests, prompts of randint(64, 512) tokens,
  randint(32, 256) outputs, greedy, ignore_eos; ``throughput.standard_workload``) with a KV
  budget of ``--workload-kv-memory`` bytes, small enough that the model dtype's cache
  preempts, for the model dtype's cache and each of ``--serving-kv-dtypes``: output tok/s
  of a timed pass stepping the engine (rounds alternate dtypes), the peak number of running
  requests after any step, and the preemptions.

A table per part, then one JSON line.

    .venv/bin/python benchmarks/kv_quant.py [--model default] [--kv-dtypes int8,int4,fp8_e5m2]
        [--parts quality,capacity,attention,serving] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention.select import get_backend  # noqa: E402
from pagedllm.core.outputs import ScheduledSequence  # noqa: E402
from pagedllm.engine.outputs import Logprob, PromptLogprobs, top_logprobs  # noqa: E402
from pagedllm.kv_dtypes import (  # noqa: E402
    FLOAT_BYTES,
    UNQUANTIZED_FIRST_BLOCK_DTYPES,
    kv_bytes_per_block,
)
from pagedllm.model.config import ModelConfig  # noqa: E402
from pagedllm.worker.input_batch import build_input_batch  # noqa: E402
from pagedllm.worker.kv_cache import KVCacheSpec, make_kv_cache  # noqa: E402
from throughput import Workload, resolve_model, standard_workload  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
BLOCK_SIZE = 16
PARTS = ("quality", "capacity", "attention", "serving")


# ---------------------------------------------------------------- quality


@dataclass(frozen=True, slots=True)
class Quality:
    """One dtype's prompt log-probabilities against the model dtype's, over ``positions``."""

    positions: int
    ppl_reference: float
    ppl: float
    mean_kl: float
    top1: float

    @property
    def delta_ppl(self) -> float:
        return self.ppl - self.ppl_reference


def bucket_kl(
    reference: Sequence[tuple[int, Logprob]], test: Sequence[tuple[int, Logprob]]
) -> float:
    """KL(reference || test) over the top tokens both list (``top_logprobs``), plus one
    bucket for the rest of the vocabulary (a lower bound of the full KL)."""
    test_lp = {token_id: entry.logprob for token_id, entry in test}
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for token_id, entry in reference:
        lp = entry.logprob
        if token_id in test_lp:
            p, q = math.exp(lp), math.exp(test_lp[token_id])
            kl += p * (lp - test_lp[token_id])
            p_rest -= p
            q_rest -= q
    p_rest, q_rest = max(p_rest, 1e-12), max(q_rest, 1e-12)
    return kl + p_rest * math.log(p_rest / q_rest)


def compare(
    prompts: Sequence[Sequence[int]],
    reference: Sequence[PromptLogprobs],
    test: Sequence[PromptLogprobs],
    top_k: int,
) -> Quality:
    """Per-prompt lists of prompt logprobs (vLLM's shape: None first, then the prompt
    token and the ``top_k`` per position) compared position by position."""
    nll_ref = nll = kl = 0.0
    agree = positions = 0
    for prompt, ref_prompt, test_prompt in zip(prompts, reference, test, strict=True):
        for token_id, r, t in zip(prompt, ref_prompt, test_prompt, strict=True):
            if r is None or t is None:
                continue
            positions += 1
            nll_ref -= r[token_id].logprob
            nll -= t[token_id].logprob
            r_top, t_top = top_logprobs(r, token_id, top_k), top_logprobs(t, token_id, top_k)
            kl += bucket_kl(r_top, t_top)
            agree += r_top[0][0] == t_top[0][0]
    if not positions:
        raise ValueError("no scored positions")
    return Quality(
        positions,
        math.exp(nll_ref / positions),
        math.exp(nll / positions),
        kl / positions,
        agree / positions,
    )


def text_prompts(model: Path, count: int, tokens: int) -> list[list[int]]:
    """``count`` consecutive pieces of ``tokens`` tokens of the public-domain text."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model)).encode(TEXT.read_text())
    if len(ids) < count * tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} x {tokens}")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(count)]


@dataclass(frozen=True, slots=True)
class QualityCase:
    """A cache to measure: ``kv_dtype`` with ``first_block`` (None: the engine's default)."""

    label: str
    kv_dtype: str
    first_block: bool | None = None


def quality_cases(kv_dtypes: Sequence[str], first_block: str) -> list[QualityCase]:
    if first_block == "default":
        return [QualityCase(kv, kv) for kv in kv_dtypes]
    return [
        QualityCase(f"{kv} b0={'full' if keep else 'quant'}", kv, keep)
        for kv in kv_dtypes
        for keep in (True, False)
    ]


def prompt_logprobs(
    model: Path,
    dtype: str,
    kv_dtype: str,
    prompts: list[list[int]],
    top_k: int,
    first_block: bool | None = None,
) -> list[PromptLogprobs]:
    llm = LLM(
        model=str(model),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        kv_cache_unquantized_first_block=first_block,
        kv_cache_memory=256 << 20,
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=top_k)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = [o.prompt_logprobs for o in outputs]
    del llm
    gc.collect()
    return result


def measure_quality(args: argparse.Namespace, model: Path) -> dict[str, Quality]:
    prompts = text_prompts(model, args.texts, args.text_tokens)
    reference = prompt_logprobs(model, args.dtype, "auto", prompts, args.top_k)
    results = {}
    for case in quality_cases(args.kv_dtypes, args.first_block):
        test = prompt_logprobs(
            model, args.dtype, case.kv_dtype, prompts, args.top_k, case.first_block
        )
        results[case.label] = compare(prompts, reference, test, args.top_k)
    return results


def measure_full_logits(args: argparse.Namespace, model: Path) -> dict[str, Quality]:
    """Full-logit KL, top-1 and perplexity per case, the texts teacher-forced through a
    runner of the case's cache (the quality gate's construction), pooled over the texts."""
    from pagedllm.model.loader import load_model
    from pagedllm.worker.model_runner import TorchModelRunner
    from pagedllm.worker.quality import compare as compare_logits
    from pagedllm.worker.quality import text_logits

    loaded = load_model(str(model), args.dtype, get_backend("cpu"))
    prompts = text_prompts(model, args.texts, args.text_tokens)

    def logits(kv_dtype: str, first_block: bool) -> list[torch.Tensor]:
        runner = TorchModelRunner(
            loaded.model, block_size=BLOCK_SIZE, num_blocks=-(-args.text_tokens // BLOCK_SIZE),
            kv_cache_dtype=kv_dtype, unquantized_first_block=first_block,
        )  # fmt: skip
        return [text_logits(runner, ids) for ids in prompts]

    reference = logits("auto", False)
    results = {}
    for case in quality_cases(args.kv_dtypes, args.first_block):
        first = case.first_block
        if first is None:
            first = case.kv_dtype in UNQUANTIZED_FIRST_BLOCK_DTYPES
        reports = [
            compare_logits(ref, test, ids[1:])
            for ref, test, ids in zip(reference, logits(case.kv_dtype, first), prompts, strict=True)
        ]
        n = sum(r.num_positions for r in reports)
        results[case.label] = Quality(
            n,
            math.exp(sum(math.log(r.ppl_reference) * r.num_positions for r in reports) / n),
            math.exp(sum(math.log(r.ppl) * r.num_positions for r in reports) / n),
            sum(r.mean_kl * r.num_positions for r in reports) / n,
            sum(r.top1_agreement * r.num_positions for r in reports) / n,
        )
    return results


# ---------------------------------------------------------------- capacity


def geometry(model: Path) -> dict[str, int]:
    config = ModelConfig.from_file(model)
    return {
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "block_size": BLOCK_SIZE,
    }


def capacity(kv_dtypes: Sequence[str], geo: dict[str, int], memory: int) -> dict[str, dict]:
    rows = {}
    for kv in ("bfloat16", *kv_dtypes):
        block = kv_bytes_per_block(kv, **geo)
        rows[kv] = {"bytes_per_token": block / BLOCK_SIZE, "blocks": memory // block}
    for row in rows.values():
        row["blocks_vs_bf16"] = row["blocks"] / rows["bfloat16"]["blocks"]
    return rows


# ---------------------------------------------------------------- decode attention


@dataclass(slots=True)
class DecodeCase:
    """A decode step of ``batch`` sequences over ``context`` cached tokens through every
    layer of one cache (blocks shuffled), ready to time."""

    cache: object
    backend: object
    scheduled: list[ScheduledSequence]
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    scale: float

    def step(self) -> None:
        meta = build_input_batch(self.scheduled, BLOCK_SIZE).meta
        meta.quant = self.cache.plan_step(meta)
        for k_cache, v_cache in self.cache.device_caches:
            self.backend.forward(*self.qkv, k_cache, v_cache, meta, self.scale)
        self.cache.finish_step()


def decode_case(
    kv: str,
    geo: dict[str, int],
    num_heads: int,
    batch: int,
    context: int,
    dtype: torch.dtype,
    first_block: bool = False,
) -> DecodeCase:
    """``kv``: a full-precision cache dtype (``float32``, ``bfloat16``; ``auto`` is
    ``dtype``) or a quantized one (open blocks in ``dtype``); queries and K/V rows in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    per_seq = context // BLOCK_SIZE + 1
    num_blocks = batch * per_seq
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    plain = kv == "auto" or kv in FLOAT_BYTES
    quantization = None if plain else kv
    cache_dtype = getattr(torch, kv) if kv in FLOAT_BYTES else dtype
    spec = KVCacheSpec(
        geo["num_layers"], geo["num_kv_heads"], geo["head_dim"], BLOCK_SIZE, cache_dtype,
        quantization=quantization, unquantized_first_block=first_block,
    )  # fmt: skip
    cache = make_kv_cache(spec, num_blocks)
    shape = (num_blocks, BLOCK_SIZE, geo["num_kv_heads"], geo["head_dim"])
    for sides in cache.device_caches:
        for side in sides:
            rows = torch.randn(shape, generator=gen).to(cache_dtype)
            if quantization is None:
                side.copy_(rows)
            else:
                side.seal(torch.arange(num_blocks), rows)
    scheduled = [
        ScheduledSequence(f"s{i}", (1,), context, tuple(ids[i * per_seq : (i + 1) * per_seq]))
        for i in range(batch)
    ]
    if first_block:  # each sequence's block 0 staged, as the disk tier loads one
        element = torch.empty((), dtype=dtype).element_size()
        staged = torch.randn(spec.staging_bytes_per_slot // element, generator=gen).to(dtype)
        row = staged.view(torch.uint8).numpy()
        cache.write_blocks([seq.block_table[0] for seq in scheduled], [row] * batch)
    head_dim, kv_heads = geo["head_dim"], geo["num_kv_heads"]
    qkv = (
        torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype),
        torch.randn(batch, kv_heads, head_dim, generator=gen).to(dtype),
        torch.randn(batch, kv_heads, head_dim, generator=gen).to(dtype),
    )
    return DecodeCase(cache, get_backend("cpu"), scheduled, qkv, head_dim**-0.5)


def time_step(case: DecodeCase, min_time: float) -> float:
    """Median seconds of one step over calls lasting ``min_time``."""
    case.step()
    times = []
    deadline = time.perf_counter() + min_time
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        case.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_attention(
    args: argparse.Namespace, geo: dict[str, int], num_heads: int
) -> dict[str, dict[str, dict]]:
    dtype = getattr(torch, args.attention_dtype)
    geo = {**geo, "num_layers": min(geo["num_layers"], args.attention_layers or geo["num_layers"])}
    results: dict[str, dict[str, dict]] = {}
    for context, batch in args.contexts:
        label = f"{batch}x{context}"
        cases = {
            kv: decode_case(kv, geo, num_heads, batch, context, dtype)
            for kv in ("bfloat16", *args.plain_kv_dtypes)
        }
        for case in quality_cases(args.kv_dtypes, args.first_block):
            first = case.first_block
            if first is None:
                first = case.kv_dtype in UNQUANTIZED_FIRST_BLOCK_DTYPES
            cases[case.label] = decode_case(
                case.kv_dtype, geo, num_heads, batch, context, dtype, first
            )
        times: dict[str, list[float]] = {kv: [] for kv in cases}
        for _ in range(args.rounds):
            for kv, case in cases.items():
                times[kv].append(time_step(case, args.min_time))
        results[label] = {kv: summary(t, times["bfloat16"]) for kv, t in times.items()}
        del cases
        gc.collect()
    return results


def summary(seconds: list[float], baseline: list[float]) -> dict:
    ratios = [s / b for s, b in zip(seconds, baseline, strict=True)]
    return {
        "ms": statistics.median(seconds) * 1e3,
        "ms_range": [min(seconds) * 1e3, max(seconds) * 1e3],
        "vs_bf16": statistics.median(ratios),
        "vs_bf16_range": [min(ratios), max(ratios)],
    }


# ---------------------------------------------------------------- serving


def serving_engine(args: argparse.Namespace, model: Path, kv: str) -> LLM:
    return LLM(
        model=str(model),
        dtype=args.serving_dtype,
        kv_cache_dtype=kv,
        kv_cache_memory=args.workload_kv_memory,
        enable_prefix_caching=False,
    )


def run_workload(llm: LLM, work: Workload) -> dict:
    """One timed pass of the workload, stepping the engine as ``LLM.generate`` does and
    noting the running requests after every step: seconds, peak running, preemptions."""
    engine = llm.engine
    before = engine.get_stats().num_preemptions
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(zip(work.prompts, work.max_tokens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"w{i}-{start}", prompt, params)
    peak = produced = 0
    while engine.has_unfinished_requests():
        for output in engine.step(finished_only=True):
            produced += len(output.outputs[0].token_ids)
        peak = max(peak, len(engine.scheduler.running))
    elapsed = time.perf_counter() - start
    if produced != work.num_output_tokens:
        raise RuntimeError(f"the engine produced {produced} tokens, not {work.num_output_tokens}")
    preemptions = engine.get_stats().num_preemptions - before
    return {"seconds": elapsed, "peak_running": peak, "preemptions": preemptions}


def measure_serving(args: argparse.Namespace, model: Path) -> dict[str, dict]:
    work = standard_workload(16 if args.quick else 64)
    engines = {kv: serving_engine(args, model, kv) for kv in ("auto", *args.serving_kv_dtypes)}
    runs: dict[str, list[dict]] = {kv: [] for kv in engines}
    for _ in range(args.serving_rounds):
        for kv, llm in engines.items():
            runs[kv].append(run_workload(llm, work))
    results = {}
    for kv, rounds in runs.items():
        speed = [work.num_output_tokens / r["seconds"] for r in rounds]
        auto = [work.num_output_tokens / r["seconds"] for r in runs["auto"]]
        ratios = [a / b for a, b in zip(speed, auto, strict=True)]
        results[kv] = {
            "blocks": engines[kv].engine.kv.num_blocks,
            "peak_running": max(r["peak_running"] for r in rounds),
            "preemptions": rounds[0]["preemptions"],
            "output_tok_s": statistics.median(speed),
            "vs_auto": statistics.median(ratios),
            "vs_auto_range": [min(ratios), max(ratios)],
        }
    for row in results.values():
        row["peak_vs_auto"] = row["peak_running"] / results["auto"]["peak_running"]
    return results


# ---------------------------------------------------------------- report


def parse_contexts(text: str) -> list[tuple[int, int]]:
    """``"2048x8,8192x2"``: (context, batch) pairs."""
    pairs = []
    for item in text.split(","):
        context, batch = item.split("x")
        pairs.append((int(context), int(batch)))
    return pairs


def print_tables(results: dict) -> None:
    titles = {
        "quality": "prompt logprobs, top-K bucket KL",
        "quality_full_logits": "teacher-forced, full-logit KL",
    }
    for part, title in titles.items():
        if part not in results:
            continue
        print(f"\nquality vs the model dtype's cache ({title})")
        print(f"{'dtype':<16} {'positions':>9} {'PPL':>8} {'ΔPPL':>8} {'mean KL':>9} {'top-1':>7}")
        for kv, q in results[part].items():
            print(
                f"{kv:<16} {q['positions']:>9} {q['ppl']:>8.3f} {q['delta_ppl']:>+8.3f} "
                f"{q['mean_kl']:>9.2e} {q['top1']:>7.2%}"
            )
    if "capacity" in results:
        print("\ncapacity")
        print(f"{'dtype':<10} {'bytes/token':>12} {'blocks':>8} {'vs bf16':>8}")
        for kv, c in results["capacity"].items():
            print(
                f"{kv:<10} {c['bytes_per_token']:>12,.0f} {c['blocks']:>8} {c['blocks_vs_bf16']:>7.2f}x"
            )
    if "attention" in results:
        setup = results["attention_setup"]
        print(
            f"\ndecode attention, one step through {setup['layers']} layers, {setup['dtype']} "
            "queries (ms; ratio to bf16, median [range])"
        )
        for label, rows in results["attention"].items():
            for kv, r in rows.items():
                lo, hi = r["vs_bf16_range"]
                fast, slow = r["ms_range"]
                print(
                    f"{label:<10} {kv:<16} {r['ms']:>8.3f} [{fast:.3f}, {slow:.3f}] "
                    f"{r['vs_bf16']:>6.2f}x [{lo:.2f}, {hi:.2f}]"
                )
    if "serving" in results:
        print("\nstandard workload at a KV budget that makes the model dtype's cache preempt")
        print(
            f"{'dtype':<10} {'blocks':>7} {'peak run':>8} {'vs auto':>8} {'preempt':>8} {'out tok/s':>10} {'vs auto':>16}"
        )
        for kv, r in results["serving"].items():
            lo, hi = r["vs_auto_range"]
            print(
                f"{kv:<10} {r['blocks']:>7} {r['peak_running']:>8} {r['peak_vs_auto']:>7.2f}x "
                f"{r['preemptions']:>8} {r['output_tok_s']:>10.1f} {r['vs_auto']:>5.2f}x [{lo:.2f}, {hi:.2f}]"
            )


def quality_rows(quality: dict[str, Quality]) -> dict[str, dict]:
    return {
        label: {
            "positions": q.positions,
            "ppl_reference": q.ppl_reference,
            "ppl": q.ppl,
            "delta_ppl": q.delta_ppl,
            "mean_kl": q.mean_kl,
            "top1": q.top1,
        }
        for label, q in quality.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-dtypes", default="int8,int4,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--dtype", default="float32", help="model dtype for the quality part")
    parser.add_argument("--texts", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument(
        "--first-block",
        choices=("default", "both"),
        default="default",
        help="quality: each dtype as the engine defaults, or with block 0 unquantized and not",
    )
    parser.add_argument("--full-logits", action="store_true", help="quality: full-logit KL too")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes (capacity)")
    parser.add_argument("--attention-dtype", default="bfloat16", help="the model's dtype")
    parser.add_argument(
        "--plain-kv-dtypes", default="bfloat16", help="full-precision caches (attention)"
    )
    parser.add_argument(
        "--attention-layers", type=int, default=0, help="layers per step (0: the model's)"
    )
    parser.add_argument("--contexts", default="2048x8,8192x2", help="CONTEXTxBATCH,...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--serving-dtype", default="bfloat16")
    parser.add_argument("--workload-kv-memory", type=int, default=96 << 20, help="bytes")
    parser.add_argument("--serving-rounds", type=int, default=1)
    parser.add_argument("--serving-kv-dtypes", default="int8")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.kv_dtypes = [kv for kv in args.kv_dtypes.split(",") if kv]
    args.serving_kv_dtypes = [kv for kv in args.serving_kv_dtypes.split(",") if kv]
    args.plain_kv_dtypes = [kv for kv in args.plain_kv_dtypes.split(",") if kv]
    args.contexts = parse_contexts(args.contexts)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if args.quick:
        args.texts, args.text_tokens, args.rounds, args.serving_rounds = 1, 256, 2, 1
        args.contexts = [(c // 4, b) for c, b in args.contexts]
    model = resolve_model(args.model)
    config = ModelConfig.from_file(model)
    geo = geometry(model)
    results: dict = {"model": args.model, "cpu_threads": torch.get_num_threads()}
    if "quality" in parts:
        results["quality"] = quality_rows(measure_quality(args, model))
        if args.full_logits:
            results["quality_full_logits"] = quality_rows(measure_full_logits(args, model))
    if "capacity" in parts:
        results["capacity"] = capacity(args.kv_dtypes, geo, args.kv_cache_memory)
    if "attention" in parts:
        results["attention_setup"] = {
            "dtype": args.attention_dtype,
            "layers": min(geo["num_layers"], args.attention_layers or geo["num_layers"]),
        }
        results["attention"] = measure_attention(args, geo, config.num_attention_heads)
    if "serving" in parts:
        results["serving"] = measure_serving(args, model)
    print_tables(results)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
