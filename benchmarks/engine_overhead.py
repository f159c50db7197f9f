"""Where a decode step's time goes at 64 running sequences.

Builds an engine on model (a) (see ``throughput.py``), admits 64 requests of the standard
workload with room to decode, steps until all of them are decoding, then times N decode
steps, split into: scheduling (``Scheduler.schedule``), building inputs (the runner's
``InputBuffers.build``), forward (model body), logits (LM head, with its fused greedy argmax
where the model has one), sampling, detokenizing, scheduler update, and the rest of
``LLMEngine.step``. Engine overhead = scheduling +
inputs + sampling + detokenizing + update + rest; goal <= 10% of step time. Steps are taken
as ``LLM.generate`` takes them (``finished_only=True``: no output built for running requests,
their text decoded when read); the text decode those steps defer is timed after them and
counted as detokenizing. ``--deltas`` takes the steps as the server's engine core does
(``LLMEngine.step_deltas`` and the wire frame of the deltas, timed as "deltas"), and
``--temperature`` samples (the serving benchmarks' default is 1.0).
Last line: one JSON object.

    .venv/bin/python benchmarks/engine_overhead.py [--model a] [--steps 32] [--profile]
    .venv/bin/python benchmarks/engine_overhead.py --model default --num-seqs 16 \\
        --temperature 1.0 --deltas
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import throughput  # noqa: E402  (sets the offline environment before any model loads)
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from pagedllm.engine.messages import Codec, Deltas  # noqa: E402

PARTS = ("schedule", "inputs", "forward", "logits", "sampling", "detokenize", "update", "deltas")
OVERHEAD = ("schedule", "inputs", "sampling", "detokenize", "update", "deltas", "rest")


class Timers:
    """Accumulates seconds per part; `wrap` times a callable under a part's name.

    `clock`: time.perf_counter (wall) or time.process_time (this process's CPU time: steadier
    on a shared machine, and equal to wall time with one thread on an idle one)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self.clock = clock

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self.clock() - start

        return timed


def instrument(llm: LLM, timers: Timers) -> None:
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timers.wrap("update", engine.scheduler.update)
    runner.input_buffers.build = timers.wrap("inputs", runner.input_buffers.build)
    model.forward = timers.wrap("forward", model.forward)
    model.compute_logits = timers.wrap("logits", model.compute_logits)
    # The LM head's fused argmax is logits work too.
    model.greedy_tokens = timers.wrap("logits", model.greedy_tokens)
    # Patched on the class, so the runner still sees its own Sampler (and may take its
    # greedy shortcut, timed as sampling too).
    sampler_cls = type(runner.sampler)
    sampler_cls.__call__ = timers.wrap("sampling", sampler_cls.__call__)
    sampler_cls.greedy_from_argmax = timers.wrap("sampling", sampler_cls.greedy_from_argmax)
    IncrementalDetokenizer.add_tokens = timers.wrap("detokenize", IncrementalDetokenizer.add_tokens)


def core_step(engine, timers: Timers, codec: Codec) -> None:
    """One step as the server's engine core takes it: deltas, encoded for the wire."""
    deltas = engine.step_deltas()
    start = timers.clock()
    codec.encode(Deltas(tuple(deltas)))
    timers.seconds["deltas"] += timers.clock() - start


def time_window(
    engine, timers: Timers, steps: int, *, deltas: bool = False
) -> tuple[dict[str, float], int]:
    """Seconds per part (PARTS and "rest") over at least ``steps`` decode steps taken as
    ``LLM.generate`` takes them (``deltas``: as the server's engine core takes them), plus
    the text decode those steps defer; and the number of model steps (more than ``steps``
    when a multi-step schedule ends past it)."""
    timers.seconds.clear()
    timers.enabled = True
    first = engine.num_steps
    codec = Codec()
    start = timers.clock()
    while engine.num_steps - first < steps:
        if deltas:
            core_step(engine, timers, codec)
        else:
            engine.step(finished_only=True)
    # Finished-only steps leave the text of running requests to be decoded when it is
    # read (at the request's end): decode the window's tokens now (as one window each,
    # timed as detokenizing by the add_tokens wrapper) and count that too.
    # With ``deltas`` the server process detokenizes, not the core.
    for state in () if deltas else engine.output_processor.requests.values():
        for seq in state.seqs.values():
            seq.text  # noqa: B018  (reading the text decodes the window)
    total = timers.clock() - start
    timers.enabled = False
    parts = {p: timers.seconds[p] for p in PARTS}
    parts["rest"] = max(0.0, total - sum(parts.values()))
    return parts, engine.num_steps - first


def overhead_fraction(parts: dict[str, float]) -> float:
    return sum(parts[p] for p in OVERHEAD) / sum(parts.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="a", help="a | default | checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per window")
    parser.add_argument(
        "--windows", type=int, default=1, help="windows of --steps; the median one is reported"
    )
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument(
        "--num-scheduler-steps", type=int, default=1, help="decode steps per schedule"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--deltas", action="store_true", help="step as the server's engine core (step_deltas)"
    )
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table")
    parser.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="process = CPU time of this process (use with --threads 1 on a busy machine)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.num_seqs < 1 or args.steps < 1 or args.windows < 1:
        raise ValueError("--num-seqs, --steps and --windows must be >= 1")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = throughput.resolve_model(args.model)
    work = throughput.standard_workload(args.num_seqs)
    kwargs = {"dtype": args.dtype, "num_scheduler_steps": args.num_scheduler_steps}
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    llm = LLM(model=str(model), **kwargs)
    engine = llm.engine
    timers = Timers(time.process_time if args.clock == "process" else time.perf_counter)
    instrument(llm, timers)
    # Every request decodes for longer than the measured window.
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=(args.steps + args.num_scheduler_steps) * args.windows + 16,
        ignore_eos=True,
    )
    for i, prompt in enumerate(work.prompts):
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.num_seqs:  # until every prompt is prefilled
        for output in engine.step():
            if output.outputs and output.outputs[0].token_ids:
                started.add(output.request_id)
    engine.step()  # the first all-decode step
    stats = engine.get_stats()
    if stats.num_running != args.num_seqs:
        raise RuntimeError(f"{stats.num_running} sequences running, expected {args.num_seqs}")

    profiler = None
    if args.profile:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    timed = [
        time_window(engine, timers, args.steps, deltas=args.deltas) for _ in range(args.windows)
    ]
    if profiler is not None:
        profiler.__exit__(None, None, None)
    windows = [parts for parts, _ in timed]
    fractions = [overhead_fraction(parts) for parts in windows]
    # The window with the median overhead fraction (the machine is shared: one window
    # can land on a busy moment).
    median = sorted(range(len(windows)), key=fractions.__getitem__)[len(windows) // 2]
    parts, fraction = windows[median], fractions[median]
    steps = timed[median][1]  # model steps: per-step figures divide by these
    total = sum(parts.values())
    step_ms = total / steps * 1e3
    print(
        f"model={model.name} dtype={args.dtype} seqs={args.num_seqs} steps={steps} "
        f"threads={torch.get_num_threads()} clock={args.clock} "
        f"num_scheduler_steps={args.num_scheduler_steps} temperature={args.temperature} "
        f"deltas={args.deltas}"
    )
    print(f"{'part':<12}{'ms/step':>10}{'share':>8}")
    for name, seconds in parts.items():
        print(f"{name:<12}{seconds / steps * 1e3:>10.3f}{seconds / total:>8.1%}")
    print(f"{'step':<12}{step_ms:>10.3f}  ({args.num_seqs / (total / steps):.0f} tok/s)")
    print(f"engine overhead {fraction:.1%} of step time (goal <= 10%)", end="")
    if len(windows) > 1:
        listed = ", ".join(f"{f:.1%}" for f in fractions)
        print(f"; median window of {len(windows)}: {listed}", end="")
    print()
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    result = {
        "num_seqs": args.num_seqs,
        "steps": steps,
        "num_scheduler_steps": args.num_scheduler_steps,
        "temperature": args.temperature,
        "deltas": args.deltas,
        "step_ms": round(step_ms, 3),
        "parts_ms": {k: round(v / steps * 1e3, 4) for k, v in parts.items()},
        "overhead_fraction": round(fraction, 4),
        "window_overhead_fractions": [round(f, 4) for f in fractions],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
