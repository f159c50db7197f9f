"""Offline throughput on the standard workload, pagedllm vs Hugging Face (vs vLLM).

The standard workload (keep it exactly, so figures compare across engines and over time):
``random.seed(0)``; 64 requests, each a prompt of ``randint(64, 512)`` token ids drawn with
``randint(0, 10000)`` and ``max_tokens = randint(32, 256)``; greedy, ``ignore_eos``; one
warm-up generate, then one timed generate of all requests. Output tok/s = sum(max_tokens) /
wall time; total tok/s adds the prompt tokens.

Models: ``a`` = random-weight Llama (hidden 512, intermediate 1536, 8 layers, 8 heads, 2 KV
heads, vocab 32000, 4096 positions; ~57M parameters), built into ``benchmarks/.models/`` if
missing; ``default`` = pagedllm's default model; or a checkpoint directory.

Baselines in the same run: Hugging Face ``generate`` on the same checkpoint, static padded
batches (8 and 32 by default, greedy, min_new_tokens = max_new_tokens); with
``--vs-vllm PYTHON``, vLLM's ``LLM.generate`` run by that interpreter in a subprocess
(vLLM-CPU needs ``VLLM_CPU_KVCACHE_SPACE=<GiB>`` in the environment; its best configuration
also preloads tcmalloc and Intel OpenMP through ``LD_PRELOAD``; ``VLLM_CPU_OMP_THREADS_BIND``
defaults to every core here, since vLLM's own default keeps one of two for its front end, and
the result records the binding that ran).
A roofline note compares the workload's matrix FLOPs per second with the ``F.linear``
ceiling measured in the same run, and a floor adds what no engine can avoid: each decode step
streams every weight and its contexts' K/V at the memory bandwidth measured in the same run,
or does its matrix work at the ceiling, whichever takes longer; prompts cost their matrix
work at the ceiling (see ``Floor``). Both rates are sampled
before the engines, before every turn and after them, and the highest reading counts: a
shared machine's matrix rate swings within minutes, and a ceiling read only at the ends can
catch two slow moments. Where the CPU's own
multiply-add instruction for the dtype can be timed (``dot_peak.py``: bf16 dot products
without AMX, float32 FMAs), a second floor puts the matrix work at that peak instead: a bound
no kernel can beat. The last line is one JSON object keyed by engine.

``--rounds N`` loads every engine once (vLLM in a child process that waits for its turn),
then times N generates of each, the engines taking turns: figures are the median round, and
the pagedllm / other ratio is the median of the per-round ratios. On a shared machine whose
speed swings within minutes, that ratio is the one to quote. Before each turn the prefix
caches are reset (every round computes its prompts) and the machine is let go idle (vLLM's
processes stay busy for a while after each of its generates).

``--phases`` also times, in each engine's turn, a generate of the same prompts with one output
token each (the prompt phase), and splits every engine's figure into the prompt phase and the
rest (the decode steps after the prompts), with pagedllm's speed over each other engine per
phase: where a ratio comes from (matrix work on prompts, memory-bound decode steps).

    .venv/bin/python benchmarks/throughput.py --model a --dtype bfloat16 [--quick] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# The benchmarks' shared pieces sit beside them (run as scripts or loaded by path in tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dot_peak import instruction_peak  # noqa: E402
from vllm_child import VllmChild  # noqa: E402

MODELS_DIR = Path(__file__).resolve().parent / ".models"
MODEL_A = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@dataclass(slots=True, frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def prompt_phase(self) -> Workload:
        """The same prompts, one output token each: every prompt computed, no decode steps."""
        return Workload(self.prompts, [1] * len(self.prompts))


def standard_workload(num_requests: int = 64) -> Workload:
    """The standard workload; the first `num_requests` draws of it (16 for --quick)."""
    return random_workload(num_requests, (64, 512), (32, 256))


def long_workload(num_requests: int = 16) -> Workload:
    """Contexts of about 4k tokens: prompts of ``randint(3584, 3968)`` token ids and
    ``randint(32, 128)`` output tokens each (model (a) holds 4096 positions)."""
    return random_workload(num_requests, (3584, 3968), (32, 128))


def random_workload(
    num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int]
) -> Workload:
    """``random.seed(0)``; per request a prompt of ``randint(*prompt_lens)`` token ids drawn
    with ``randint(0, 10000)``, then ``max_tokens = randint(*output_lens)``."""
    random.seed(0)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        prompts.append([random.randint(0, 10000) for _ in range(random.randint(*prompt_lens))])
        max_tokens.append(random.randint(*output_lens))
    return Workload(prompts, max_tokens)


def warmup_workload() -> Workload:
    rng = random.Random(1)
    return Workload([[rng.randint(0, 10000) for _ in range(32)] for _ in range(2)], [8, 8])


# ---------------------------------------------------------------- model (a)


def ensure_model_a() -> Path:
    """Build the random-weight model (a) (bf16 safetensors + a 32000-word tokenizer) once."""
    path = MODELS_DIR / "model-a"
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = MODELS_DIR / f"model-a.tmp{os.getpid()}"
    config = LlamaConfig(**MODEL_A, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    word_tokenizer(MODEL_A["vocab_size"]).save_pretrained(tmp)
    if path.exists():  # a partial older build
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer: token i is the word "w<i>" (ids 0-2 are <pad>, <s>, </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def resolve_model(name: str) -> Path:
    if name == "a":
        return ensure_model_a()
    if name == "default":
        from pagedllm.model.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(name)
    if not (path / "config.json").exists():
        raise ValueError(f"--model: {name!r} is neither a, default nor a checkpoint directory")
    return path


# ---------------------------------------------------------------- engines


@dataclass(slots=True)
class Started:
    """An engine loaded and warmed up: ``run()`` times one generate of the workload."""

    name: str
    run: Callable[[], float]
    extra: dict
    close: Callable[[], None] = lambda: None
    # Times one generate of the workload's prompt phase (``Workload.prompt_phase``).
    run_prompts: Callable[[], float] | None = None


def start_pagedllm(model: Path, dtype: str, work: Workload, args: argparse.Namespace) -> Started:
    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    kwargs = {"dtype": dtype}
    if args.num_scheduler_steps is not None:
        kwargs["num_scheduler_steps"] = args.num_scheduler_steps
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if args.device != "cpu":
        kwargs["device"] = args.device
    llm = LLM(model=str(model), **kwargs)
    startup = time.perf_counter() - start

    def generate(w: Workload) -> float:
        prompts = [{"prompt_token_ids": p} for p in w.prompts]
        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in w.max_tokens
        ]
        # Every round computes its prompts: the last round's stay in the prefix cache.
        if not llm.reset_prefix_cache():
            raise RuntimeError("pagedllm refused to reset its prefix cache")
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != w.num_output_tokens:
            raise RuntimeError(
                f"pagedllm produced {produced} tokens, expected {w.num_output_tokens}"
            )
        return elapsed

    generate(warmup_workload())
    extra = {
        "startup_s": round(startup, 2),
        "num_scheduler_steps": llm.engine.scheduler.config.num_scheduler_steps,
    }
    return Started(
        "pagedllm",
        lambda: generate(work),
        extra,
        run_prompts=partial(generate, work.prompt_phase()),
    )


def start_hf(
    model: Path, dtype: str, work: Workload, batch_sizes: list[int], device: str = "cpu"
) -> list[Started]:
    """transformers generate, static left-padded batches in request order: one engine per
    batch size, sharing one loaded model."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    hf = hf.to(device)
    startup = time.perf_counter() - start
    pad_id = 0

    def generate(w: Workload, batch_size: int) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(w.prompts), batch_size):
            prompts = w.prompts[i : i + batch_size]
            new = max(w.max_tokens[i : i + batch_size])
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
            )
            with torch.inference_mode():
                hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=pad_id,
                )
        return time.perf_counter() - t0

    engines = []
    for batch in batch_sizes:
        generate(warmup_workload(), batch)
        extra = {"startup_s": round(startup, 2), "batch_size": batch}
        engines.append(
            Started(
                f"hf batch {batch}",
                partial(generate, work, batch),
                extra,
                run_prompts=partial(generate, work.prompt_phase(), batch),
            )
        )
    return engines


# The vLLM side: a child process in vLLM's own environment that loads the model, warms up,
# says VLLM_READY, then times one generate per "run" line on stdin (VLLM_RESULT), or of the
# prompts with one output token each per "prompts" line, until "quit".
VLLM_SCRIPT = r"""
import json, sys, time


def generate(llm, SamplingParams, prompts, max_tokens):
    items = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    t = time.perf_counter()
    outs = llm.generate(items, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(max_tokens), (produced, sum(max_tokens))
    return elapsed


def main():
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0)
    startup = time.perf_counter() - t0
    generate(llm, SamplingParams, *spec["warmup"])
    print("VLLM_READY " + json.dumps({"startup_s": startup}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command not in ("run", "prompts"):
            break
        # Every round computes its prompts (where vLLM caches prefixes, the last round's stay).
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()
        max_tokens = spec["max_tokens"] if command == "run" else [1] * len(spec["prompts"])
        elapsed = generate(llm, SamplingParams, spec["prompts"], max_tokens)
        print("VLLM_RESULT " + json.dumps({"elapsed": elapsed}), flush=True)


# vLLM starts its engine core in a child process: the guard keeps the child from re-running this.
if __name__ == "__main__":
    main()
"""


def start_vllm(python: str, model: Path, dtype: str, work: Workload) -> Started:
    warm = warmup_workload()
    spec = {
        "model": str(model),
        "dtype": dtype,
        "prompts": work.prompts,
        "max_tokens": work.max_tokens,
        "warmup": [warm.prompts, warm.max_tokens],
    }
    child = VllmChild(python, VLLM_SCRIPT, spec)
    extra = {
        "startup_s": round(child.ready["startup_s"], 2),
        "omp_threads_bind": child.env["VLLM_CPU_OMP_THREADS_BIND"],
    }

    def run(command: str = "run") -> float:
        return child.ask(command)["elapsed"]

    return Started("vllm", run, extra, child.close, partial(run, "prompts"))


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def settle(
    read: Callable[[], tuple[int, int] | None] = cpu_times,
    sleep: Callable[[float], None] = time.sleep,
    *,
    interval: float = 0.5,
    busy_below: float = 0.1,
    limit: float = 10.0,
) -> float:
    """Wait until the machine is idle (busy under `busy_below` over one `interval`), at most
    `limit` seconds; returns the seconds waited. vLLM's processes stay busy for a while
    after loading and after each generate, which would slow whichever engine went next."""
    waited = 0.0
    before = read()
    while waited < limit:
        sleep(interval)
        waited += interval
        after = read()
        if before is None or after is None:
            return waited
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < busy_below:
            return waited
        before = after
    return waited


def run_rounds(
    engines: list[Started],
    rounds: int,
    wait: Callable[[], object] = settle,
    *,
    phases: bool = False,
    neighbours: int = 0,
) -> dict[str, list[float]]:
    """Seconds of each engine's timed generate, `rounds` times, the engines taking turns
    (in reverse order every other round), so that every engine meets the machine's slow
    and fast minutes alike; before each turn, `wait` for the last engine to go quiet.
    With `phases`, each turn first times the prompt phase alone (``run_prompts``), under
    the name ``phase_name(engine)``. With ``neighbours``, each turn then times the workload
    again beside that many busy-looping processes, under ``noisy_name(engine, n)``."""
    times: dict[str, list[float]] = {e.name: [] for e in engines}
    for r in range(rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            if phases and engine.run_prompts is not None:
                wait()
                times.setdefault(phase_name(engine.name), []).append(engine.run_prompts())
            wait()
            times[engine.name].append(engine.run())
            if neighbours:
                with busy_neighbours(neighbours):
                    noisy = times.setdefault(noisy_name(engine.name, neighbours), [])
                    noisy.append(engine.run())
    return times


def noisy_name(name: str, neighbours: int) -> str:
    return f"{name} beside {neighbours} busy"


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPU (as a noisy neighbour on a shared host)
    while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let them reach the run queue
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def phase_name(name: str) -> str:
    return f"{name} prompts"


def phase_split(times: dict[str, list[float]], name: str) -> tuple[list[float], list[float]] | None:
    """Per round, (prompt phase, the rest = whole workload - prompt phase) of one engine, or
    None without a prompt phase. The rest is the decode steps that follow the prompts; the
    whole run's prompt steps also carry the first requests' decodes, so it is approximate."""
    prompts = times.get(phase_name(name))
    if prompts is None:
        return None
    return prompts, [whole - p for whole, p in zip(times[name], prompts, strict=True)]


def summarize(work: Workload, engine: Started, seconds: list[float]) -> dict:
    """The engine's result at the median round; every round's output tok/s alongside."""
    res = result(work, statistics.median(seconds), **engine.extra)
    if len(seconds) > 1:
        res["rounds_output_tok_per_s"] = [round(work.num_output_tokens / s, 1) for s in seconds]
    return res


def round_ratios(mine: list[float], other: list[float]) -> list[float]:
    """Per round, pagedllm's speed over the other engine's (their times inverted)."""
    return [o / m for m, o in zip(mine, other, strict=True)]


def result(work: Workload, elapsed: float, **extra) -> dict:
    return {
        "output_tok_per_s": round(work.num_output_tokens / elapsed, 1),
        "total_tok_per_s": round((work.num_output_tokens + work.num_prompt_tokens) / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        **extra,
    }


# ---------------------------------------------------------------- roofline


def matmul_ceiling(dtype: torch.dtype, size: int = 2048, seconds: float = 1.0) -> float:
    """F.linear FLOP/s on [size, size] x [size, size]^T, best of a few rounds."""
    x = torch.randn(size, size).to(dtype)
    w = torch.randn(size, size).to(dtype)
    F.linear(x, w)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            F.linear(x, w)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t0))
    return best


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline and the floor need from a checkpoint's config.json."""

    body_params: int  # every decoder layer's linear weights
    head_params: int  # the LM head
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def attention_flops(self, keys: int) -> float:
        """One query position through every layer's attention over `keys` keys: the
        scores (Q.K) and the weighted sum of V, every query head."""
        return 4.0 * self.heads * self.head_dim * keys * self.layers

    def prompt_attention_flops(self, prompts: list[list[int]]) -> float:
        """The prompts' causal attention: position p (from 1) of a prompt sees p keys."""
        return sum(self.attention_flops(len(p) * (len(p) + 1) // 2) for p in prompts)

    @classmethod
    def read(cls, model: Path) -> ModelShape:
        config = json.loads((model / "config.json").read_text())
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        per_layer += 3 * hidden * inter
        layers = config["num_hidden_layers"]
        return cls(
            body_params=per_layer * layers,
            head_params=hidden * config["vocab_size"],
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
        )


def workload_flops(model: Path, work: Workload) -> float:
    """Matrix FLOPs of the workload: every token through every linear layer; only tokens
    that produce an output (the output tokens) through the LM head; every prompt's causal
    attention and every decoded token's attention over its context."""
    shape = ModelShape.read(model)
    tokens = work.num_prompt_tokens + work.num_output_tokens
    linears = 2.0 * (shape.body_params * tokens + shape.head_params * work.num_output_tokens)
    decode = sum(shape.attention_flops(sum(keys)) for keys in decode_contexts(work))
    return linears + shape.prompt_attention_flops(work.prompts) + decode


def decode_contexts(work: Workload) -> list[list[int]]:
    """Each decode step's running requests, as the keys each one's token sees. Step j (from
    1) runs every request with more than j output tokens (the first comes from the prompt's
    step); its input sits at position len(prompt) + j - 1 and sees every position up to it."""
    return [
        [len(p) + step for p, n in zip(work.prompts, work.max_tokens, strict=True) if n > step]
        for step in range(1, max(work.max_tokens))
    ]


def read_bandwidth(size_bytes: int = 512 << 20, seconds: float = 1.0) -> float:
    """Bytes/s that the engine's threads read from memory (a sum over a tensor far larger
    than the caches), best of a few rounds."""
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    x.sum()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        x.sum()
        best = max(best, size_bytes / (time.perf_counter() - t0))
    return best


@dataclass
class MachineRates:
    """The highest F.linear rate (per dtype name) and read bandwidth sampled over a run."""

    dtypes: tuple[str, ...]
    ceilings: dict[str, float] = field(default_factory=dict)
    bandwidth: float = 0.0

    def sample(self, seconds: float = 1.0) -> None:
        for name in self.dtypes:
            rate = matmul_ceiling(getattr(torch, name), seconds=seconds)
            self.ceilings[name] = max(self.ceilings.get(name, 0.0), rate)
        self.bandwidth = max(self.bandwidth, read_bandwidth(seconds=seconds))


def settle_and_sample(rates: MachineRates, seconds: float = 0.25) -> None:
    """Before an engine's turn: let the machine go idle, then sample its rates briefly."""
    settle()
    rates.sample(seconds)


def report_peak_floor(
    floor: Floor, bandwidth: float, dtype: str, num_output_tokens: int, results: dict
) -> None:
    """The floor again with the matrix work at the instruction's peak (``dot_peak.py``),
    where this CPU's unit for `dtype` can be timed; each engine's share of its speed."""
    peak, why = instruction_peak(dtype)
    if peak is None:
        print(f"peak floor: not measured ({why})")
        return
    decode_s, prompts_s = floor.seconds(bandwidth, peak)
    floor_s = decode_s + prompts_s
    print(
        f"peak floor: the matrix work at the {why} peak ({peak / 1e12:.3f} TFLOP/s, registers "
        f"only): decode {decode_s:.2f} s + prompts {prompts_s:.2f} s; no engine finishes in "
        f"under {floor_s:.2f} s ({num_output_tokens / floor_s:.0f} output tok/s)"
    )
    for res in results.values():
        if "elapsed_s" in res:
            res["roofline"]["peak_tflop_per_s"] = round(peak / 1e12, 4)
    record_floor(results, floor_s, "peak_floor")


def record_floor(results: dict, floor_s: float, name: str) -> None:
    """Each timed engine's share of a floor's speed: ``{name}_s`` and
    ``fraction_of_{name}_speed`` in its roofline, and a line each."""
    for engine, res in results.items():
        if "elapsed_s" in res:
            res["roofline"][f"{name}_s"] = round(floor_s, 3)
            res["roofline"][f"fraction_of_{name}_speed"] = round(floor_s / res["elapsed_s"], 4)
            print(f"  {engine}: {floor_s / res['elapsed_s']:.1%} of {name.replace('_', '-')} speed")


@dataclass(frozen=True, slots=True)
class Floor:
    """A lower bound on the workload's time on this machine, for any engine.

    A decode step streams every weight once and every running request's context K/V, and
    multiplies each running request's token through every weight and its context's K/V:
    it takes at least the longer of the two, the bytes at the measured bandwidth or the
    matrix work at the measured ceiling. With a few rows the bytes dominate; with many
    (model (a) on a CPU without a matrix unit: from about 16 rows) the matrix work does.
    The steps are ``decode_contexts``. Prompts are compute-bound (``prefill_flops``, their
    linears and causal attention, at the ceiling; at 4k-token prompts attention is over a
    third of it). The two phases barely overlap (a step is either a big prefill or a
    decode), so the floor is their sum."""

    weight_bytes: float  # streamed by every decode step
    step_kv_bytes: tuple[float, ...]  # each decode step's K/V reads
    step_flops: tuple[float, ...]  # each decode step's matrix work, attention included
    prefill_flops: float  # the prompts' linears and causal attention

    @property
    def decode_weight_bytes(self) -> float:
        return self.weight_bytes * len(self.step_flops)

    @property
    def kv_bytes(self) -> float:
        return sum(self.step_kv_bytes)

    @property
    def decode_flops(self) -> float:
        return sum(self.step_flops)

    def step_seconds(self, bandwidth: float, ceiling: float) -> list[tuple[float, float]]:
        """Each decode step's (bytes, matrix work) time at these rates."""
        return [
            ((self.weight_bytes + kv) / bandwidth, flops / ceiling)
            for kv, flops in zip(self.step_kv_bytes, self.step_flops, strict=True)
        ]

    def compute_bound_steps(self, bandwidth: float, ceiling: float) -> int:
        return sum(work > data for data, work in self.step_seconds(bandwidth, ceiling))

    def seconds(self, bandwidth: float, ceiling: float) -> tuple[float, float]:
        """(the decode steps, the prompts) at these rates."""
        decode = sum(max(step) for step in self.step_seconds(bandwidth, ceiling))
        return decode, self.prefill_flops / ceiling


def workload_floor(model: Path, work: Workload, dtype_bytes: int) -> Floor:
    shape = ModelShape.read(model)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
    params = shape.body_params + shape.head_params
    contexts = decode_contexts(work)
    return Floor(
        weight_bytes=float(params * dtype_bytes),
        step_kv_bytes=tuple(float(kv_per_token * sum(keys)) for keys in contexts),
        step_flops=tuple(
            2.0 * params * len(keys) + shape.attention_flops(sum(keys)) for keys in contexts
        ),
        prefill_flops=2.0 * shape.body_params * work.num_prompt_tokens
        + shape.prompt_attention_flops(work.prompts),
    )


def report_phases(times: dict[str, list[float]], results: dict[str, dict]) -> None:
    """Print and record each engine's prompt phase and the rest (medians of the rounds), and
    pagedllm's speed over each other engine per phase (medians of per-round ratios)."""
    splits = {}
    for engine, res in results.items():
        split = phase_split(times, res.get("name", engine))
        if split is None:
            continue
        splits[engine] = split
        prompts, rest = (statistics.median(x) for x in split)
        res["phases"] = {"prompts_s": round(prompts, 3), "rest_s": round(rest, 3)}
        print(f"phases: {engine}: prompts {prompts:.2f} s, the rest {rest:.2f} s")
    if "pagedllm" not in splits:
        return
    for other, split in splits.items():
        if other == "pagedllm":
            continue
        ratios = [
            statistics.median(round_ratios(mine, theirs))
            for mine, theirs in zip(splits["pagedllm"], split, strict=True)
        ]
        results["pagedllm"].setdefault("vs_phases", {})[other] = {
            "prompts": round(ratios[0], 3),
            "rest": round(ratios[1], 3),
        }
        print(f"pagedllm / {other} by phase: prompts {ratios[0]:.2f}x, the rest {ratios[1]:.2f}x")


def report_neighbours(
    times: dict[str, list[float]], results: dict[str, dict], neighbours: int
) -> None:
    """Print and record the share of its quiet throughput each engine keeps beside the
    busy neighbours: the median over rounds of quiet time / noisy time."""
    for engine, res in results.items():
        name = res.get("name", engine)
        noisy = times.get(noisy_name(name, neighbours))
        if not noisy or name not in times:
            continue
        kept = round_ratios(noisy, times[name])
        median = statistics.median(kept)
        res["beside_busy"] = {"neighbours": neighbours, "kept": round(median, 3)}
        each = ", ".join(f"{x:.0%}" for x in kept)
        print(
            f"{engine} beside {neighbours} busy neighbour(s): {median:.0%} of its quiet "
            f"throughput (rounds: {each})"
        )


# ---------------------------------------------------------------- main


def report_roofline_and_floor(
    model: Path, work: Workload, dtype_name: str, rates: MachineRates, results: dict
) -> None:
    """Each engine's share of the CPU's F.linear ceiling, and the floor no engine beats."""
    flops = workload_flops(model, work)
    rates.sample()
    ceilings = rates.ceilings
    print(
        "roofline: workload = "
        f"{flops / 1e12:.3f} TFLOP of matrix work; F.linear ceiling "
        + ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in ceilings.items())
    )
    for engine, res in results.items():
        if "elapsed_s" not in res:
            continue
        achieved = flops / res["elapsed_s"]
        fractions = {k: round(achieved / v, 4) for k, v in ceilings.items()}
        res["roofline"] = {
            "achieved_tflop_per_s": round(achieved / 1e12, 4),
            "fraction_of_ceiling": fractions,
        }
        print(
            f"  {engine}: {achieved / 1e12:.3f} TFLOP/s = "
            + ", ".join(f"{f:.1%} of the {k} ceiling" for k, f in fractions.items())
        )
    # As for the ceiling: the highest reading (the lowest floor) counts.
    bandwidth = rates.bandwidth
    floor = workload_floor(model, work, torch.finfo(getattr(torch, dtype_name)).bits // 8)
    ceiling = ceilings[dtype_name]
    decode_s, prompts_s = floor.seconds(bandwidth, ceiling)
    floor_s = decode_s + prompts_s
    print(
        f"floor: {len(floor.step_flops)} decode steps, each the longer of streaming its bytes "
        f"({floor.decode_weight_bytes / 1e9:.1f} GB of weights + {floor.kv_bytes / 1e9:.1f} GB "
        f"of K/V in all, at {bandwidth / 1e9:.1f} GB/s measured) and its matrix work "
        f"({floor.decode_flops / 1e12:.2f} TFLOP in all, at the ceiling; the longer in "
        f"{floor.compute_bound_steps(bandwidth, ceiling)} steps) = {decode_s:.2f} s; prompts "
        f"{floor.prefill_flops / 1e12:.2f} TFLOP at the ceiling = {prompts_s:.2f} s; no engine "
        f"finishes in under {floor_s:.2f} s ({work.num_output_tokens / floor_s:.0f} output tok/s)"
    )
    record_floor(results, floor_s, "floor")
    report_peak_floor(floor, bandwidth, dtype_name, work.num_output_tokens, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="a", help="a | default | checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="16 requests, HF batch 8 only")
    parser.add_argument("--num-requests", type=int, default=None, help="default 64 (16 quick)")
    parser.add_argument(
        "--hf-batch-sizes", default=None, help="comma list, default 8,32; empty to skip HF"
    )
    parser.add_argument("--vs-vllm", metavar="PYTHON", help="interpreter with vLLM installed")
    parser.add_argument("--attention-backend", default=None, help="pagedllm backend name")
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="pagedllm's greedy decode steps per schedule (default: LLM's, 8)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device for pagedllm and transformers (cuda: no CPU roofline or floor)",
    )
    parser.add_argument("--skip-pagedllm", action="store_true")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each engine's prompts alone (one output token each) every round, "
        "and split every figure into the prompt phase and the rest",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timed generates per engine, the engines taking turns; figures are medians",
    )
    parser.add_argument(
        "--long-contexts",
        action="store_true",
        help="contexts of about 4k tokens instead of the standard workload (16 requests)",
    )
    parser.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="also time every turn beside N busy-looping processes and report the share of "
        "the quiet throughput each engine keeps",
    )
    args = parser.parse_args(argv)

    num_requests = args.num_requests or (16 if args.quick or args.long_contexts else 64)
    if num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    hf_sizes = args.hf_batch_sizes
    if hf_sizes is None:
        hf_sizes = "8" if args.quick else "8,32"
    hf_batches = [int(x) for x in hf_sizes.split(",") if x.strip()]
    model = resolve_model(args.model)
    work = long_workload(num_requests) if args.long_contexts else standard_workload(num_requests)
    print(
        f"model={model} dtype={args.dtype} requests={num_requests} "
        f"prompt_tokens={work.num_prompt_tokens} output_tokens={work.num_output_tokens} "
        f"threads={torch.get_num_threads()}"
    )

    # The ceiling and the bandwidth are measured before and after the engines and before
    # every turn; the highest figure counts (a busy moment on a shared machine only lowers
    # it, and the engines' turns may meet faster minutes than either end of the run).
    on_cpu = args.device == "cpu"
    rates = MachineRates(tuple(dict.fromkeys(("bfloat16", args.dtype))))
    if on_cpu:
        rates.sample()
    engines: list[Started] = []
    results: dict[str, dict] = {}
    try:
        if not args.skip_pagedllm:
            engines.append(start_pagedllm(model, args.dtype, work, args))
        if hf_batches:
            engines.extend(start_hf(model, args.dtype, work, hf_batches, args.device))
        if args.vs_vllm:
            try:
                engines.append(start_vllm(args.vs_vllm, model, args.dtype, work))
            except RuntimeError as exc:
                results["vllm"] = {"error": str(exc)}
        times = run_rounds(
            engines,
            args.rounds,
            partial(settle_and_sample, rates) if on_cpu else settle,
            phases=args.phases,
            neighbours=args.neighbours,
        )
    finally:
        for engine in engines:
            engine.close()
    hf_runs = []
    for engine in engines:
        res = summarize(work, engine, times[engine.name])
        print(f"{engine.name}: {res}")
        if "batch_size" in engine.extra:  # one of Hugging Face's batch sizes
            hf_runs.append({**res, "name": engine.name})
        else:
            results[engine.name] = res
    if hf_runs:
        best = max(hf_runs, key=lambda r: r["output_tok_per_s"])
        results["hf"] = {**best, "runs": hf_runs}
    if "vllm" in results and "error" in results["vllm"]:
        print(f"vllm: {results['vllm']['error']}")

    if on_cpu:
        report_roofline_and_floor(model, work, args.dtype, rates, results)
    if "pagedllm" in times:
        for other in ("hf", "vllm"):
            name = results.get(other, {}).get("name", other)
            if name not in times:
                continue
            ratios = round_ratios(times["pagedllm"], times[name])
            median = statistics.median(ratios)
            results["pagedllm"].setdefault("vs", {})[other] = round(median, 3)
            each = ", ".join(f"{x:.2f}" for x in ratios)
            rounds = f" (median of {len(ratios)} rounds: {each})" if len(ratios) > 1 else ""
            print(f"pagedllm / {name} output tok/s: {median:.2f}x{rounds}")
    if args.phases:
        report_phases(times, results)
    if args.neighbours:
        report_neighbours(times, results, args.neighbours)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
