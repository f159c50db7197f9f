"""What structured outputs cost: the decode step of 16 sequences all constrained by one JSON
schema against the same 16 unconstrained, on the default model (SmolLM2-135M-Instruct).

Each configuration admits ``--num-seqs`` requests of one chat prompt, steps until every one
is decoding, then times ``--steps`` decode steps (``LLMEngine.step``, as ``LLM.generate``
takes them); configurations alternate over ``--rounds`` and the figures are medians. The
schema asks for an array of at least 100 small objects, so no constrained sequence can end
inside the timed window (the unconstrained ones ignore EOS). Mask time: the matchers' time
computing the step's bitmasks (``SequenceMatchers.mask_s``), per step. Compile time: the
schema's first compile on a fresh compiler; then a second request with the same schema,
which must compile nothing (the cache's counters say so). Goal: a constrained decode step
at most 10% longer than an unconstrained one. Last line: one JSON object.

    .venv/bin/python benchmarks/structured_outputs.py [--model default] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput  # noqa: E402, F401  (sets the offline environment before any model loads)
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "topic": {"enum": ["cache", "paging", "batching", "sampling"]},
                    "text": {"type": "string", "maxLength": 40},
                },
                "required": ["id", "topic", "text"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}
PROMPT = "List notes about how an inference engine pages its KV cache, as JSON."
CONFIGS = ("unconstrained", "constrained")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    if min(args.num_seqs, args.steps, args.rounds) < 1 or args.warmup_steps < 0:
        parser.error("--num-seqs, --steps and --rounds must be positive")
    return args


def params(config: str, args: argparse.Namespace) -> SamplingParams:
    max_tokens = args.warmup_steps + args.steps + 4
    if config == "unconstrained":
        return SamplingParams(
            temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True, seed=0
        )
    structured = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(
        temperature=args.temperature, max_tokens=max_tokens, seed=0, structured_outputs=structured
    )


def time_steps(llm: LLM, config: str, args: argparse.Namespace) -> dict[str, float]:
    """Median decode step (ms) of ``num_seqs`` sequences, and mask ms per step."""
    engine = llm.engine
    prompt = llm.encode_chat([{"role": "user", "content": PROMPT}])
    sampling = params(config, args)
    engine.structured.check(sampling)
    ids = [f"{config}-{time.monotonic_ns()}-{i}" for i in range(args.num_seqs)]
    for request_id in ids:
        engine.add_request(request_id, prompt, sampling)
    while engine.scheduler.waiting or engine.structured.compiling:  # every prompt computed
        engine.step(finished_only=True)
    for _ in range(args.warmup_steps):
        engine.step(finished_only=True)
    mask_s, num_masks = engine.structured.matchers.mask_s, engine.structured.matchers.num_masks
    steps = []
    for _ in range(args.steps):
        running = len(engine.scheduler.running)
        assert running == args.num_seqs, f"{args.num_seqs - running} sequences ended early"
        started = time.perf_counter()
        engine.step(finished_only=True)
        steps.append(time.perf_counter() - started)
    masks = engine.structured.matchers.num_masks - num_masks
    engine.abort_request(ids)
    return {
        "step_ms": statistics.median(steps) * 1e3,
        "mask_ms_per_step": (engine.structured.matchers.mask_s - mask_s) * 1e3 / args.steps,
        "masks_per_step": masks / args.steps,
    }


def compile_times(llm: LLM) -> dict[str, float | bool]:
    """The schema's first compile (a fresh compiler: its tokenizer table built first, apart)
    and a second request's (cached: nothing compiled)."""
    engine = llm.engine
    started = time.perf_counter()
    compiler = engine.structured.compiler()
    compiler.compile(StructuredOutputsParams(regex="x"))  # waits for the tokenizer table
    table_s = time.perf_counter() - started
    structured = StructuredOutputsParams(json=SCHEMA)
    started = time.perf_counter()
    grammar = compiler.compile(structured)
    first_s = time.perf_counter() - started
    before = compiler.stats()
    started = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    second_s = time.perf_counter() - started
    after = compiler.stats()
    return {
        "tokenizer_table_ms": table_s * 1e3,
        "compile_ms": first_s * 1e3,
        "compile_engine_ms": grammar.compile_s * 1e3,
        "second_compile_ms": second_s * 1e3,
        "second_request_cached": after.num_compiled == before.num_compiled
        and after.num_hits == before.num_hits + 1,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One step per schedule: a greedy unconstrained batch would otherwise run several decode
    # steps per call (multi-step), which constrained sequences never take.
    llm = LLM(model=args.model, max_num_seqs=args.num_seqs, num_scheduler_steps=1)
    compiled = compile_times(llm)
    rounds: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            rounds[config].append(time_steps(llm, config, args))
    result: dict[str, object] = {
        config: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for config, runs in rounds.items()
    }
    base = result["unconstrained"]["step_ms"]  # type: ignore[index]
    slower = result["constrained"]["step_ms"] / base - 1.0  # type: ignore[index]
    result.update(compiled)
    result.update(
        model=args.model, num_seqs=args.num_seqs, temperature=args.temperature,
        constrained_step_slower=slower, goal_met=slower <= 0.10,
    )  # fmt: skip
    print(f"{args.num_seqs} sequences, temperature {args.temperature}, model {args.model}")
    print(f"{'':16}{'step ms':>10}{'mask ms/step':>14}{'masks/step':>12}")
    for config in CONFIGS:
        row = result[config]
        print(
            f"{config:16}{row['step_ms']:>10.2f}{row['mask_ms_per_step']:>14.3f}"  # type: ignore[index]
            f"{row['masks_per_step']:>12.1f}"  # type: ignore[index]
        )
    print(f"constrained step: {slower:+.1%} (goal <= +10%)")
    print(
        f"compile: tokenizer table {compiled['tokenizer_table_ms']:.0f} ms, schema "
        f"{compiled['compile_ms']:.2f} ms, second request {compiled['second_compile_ms']:.3f} ms "
        f"(cached: {compiled['second_request_cached']})"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
