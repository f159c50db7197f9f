"""`pagedllm serve` against vLLM's OpenAI server, driven by vLLM's own benchmark client.

Starts ``pagedllm serve`` (and, with ``--vllm PYTHON``, vLLM's OpenAI server from that
interpreter) on the same model and dtype, then runs rounds: in each, every server in turn
(the order alternates) gets the same workload from vLLM's benchmark client
(``vllm.benchmarks.serve``, called as a library in the given interpreter: random dataset,
``--input-len`` in / ``--output-len`` out, ``--num-prompts``, ``--max-concurrency``,
``--ignore-eos``; round r uses seed ``--seed`` + r for every server, so the prompts of a
round are the same and no round finds the previous one's prompts in a prefix cache; the
order follows the seed's parity, so rounds split across runs with ``--seed r --rounds 1``
alternate as well). Only the server under test runs: the others are paused whole (SIGSTOP
to their process group) for its turn and for the offline timing, so that no idle server
takes CPU from the measured one.
Without ``--vllm`` pagedllm alone is driven by a client of ours (httpx) with the same
request pattern (random token-id prompts, streamed completions, the same concurrency).

Each round also records the CPU seconds the client used (a child's rusage, or this
process's own for our client) and the server's processes used (its process group, from
/proc): on a small machine the client's share of the cores is not the server's to use, and
the table shows it beside the throughput as cores (CPU seconds per wall second).

``--variant NAME=FLAGS`` adds another ``pagedllm serve`` with those extra flags (its rounds
alternate with the others'; ``--variant-src NAME=DIR`` runs that variant from another source
tree, e.g. a ``git worktree`` of an older commit, for an A/B of two trees), and
``--no-vllm-server`` uses the ``--vllm`` interpreter only for its client: a scheduling flag or
a tree measured with vLLM's client without timing vLLM's server again.

``--client-nice N`` runs the client at that nice value (the servers keep theirs): a
diagnostic that shows what the server itself costs against the offline engine when the
client does not take the cores it needs (its TTFT and ITL then include the client's own
waits for a core, so only the throughput is comparable).

``--workload json-schema`` drives every server (vLLM too) with our client on structured
outputs instead (``json_schema_workload.py``): chat requests held to one of eight realistic
JSON Schemas by ``response_format``, greedy, at most ``--output-len`` tokens, ``--num-prompts``
of them at ``--max-concurrency``; each reply is validated with ``jsonschema`` and the table
counts invalid outputs per server (and those cut by ``max_tokens``). No offline timing then.
vLLM picks its grammar backend itself (``auto``: xgrammar unless the schema needs another)
unless told, e.g. ``--vllm-arg=--structured-outputs-config.backend=guidance``.

Each round also times the offline ``LLM.generate`` on the same kind of requests (random
prompts of the same lengths, ``max_num_seqs`` = the concurrency, same sampling), so that
the server can be checked against the engine alone. Prints a table of medians (with the
spread over rounds) and the ratios, then one JSON line.

    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm VLLM_PY --rounds 3
    .venv/bin/python benchmarks/serve_vs_vllm.py --input-len 4096 --num-prompts 16 --rounds 2
    .venv/bin/python benchmarks/serve_vs_vllm.py --workload json-schema --vllm VLLM_PY \
        --dtype float32 --num-prompts 32 --max-concurrency 16 --output-len 256 --rounds 3

vLLM runs with ``VLLM_CPU_OMP_THREADS_BIND`` (default ``0-<last core>``) unless set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402

from pagedllm.kernels.probe import cpu_info  # noqa: E402

# The benchmarks' shared pieces sit beside them (run as scripts or loaded by path in tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import json_schema_workload  # noqa: E402
from vllm_child import vllm_env  # noqa: E402

METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms")
CPU_METRICS = ("client_cores", "server_cores")
# The json-schema workload's own: latency (not streamed: no TTFT or ITL) and validity.
STRUCTURED_METRICS = ("mean_latency_ms", "invalid", "truncated", "invalid_uncut")
WORKLOADS = ("random", "json-schema")
READY_TIMEOUT_S = 600.0

# Run by the --vllm interpreter: vLLM's benchmark client on one server, one JSON line out.
VLLM_CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(json.loads(sys.argv[1])))
keys = ("completed", "failed", "duration", "total_output_tokens", "output_throughput",
        "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms")
print("BENCH_RESULT " + json.dumps({k: result.get(k) for k in keys}), flush=True)
"""

# Run by this interpreter: the offline LLM on the workload, one JSON line out.
OFFLINE = """
import json, sys, time
from pagedllm import LLM, SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_concurrency"])
params = SamplingParams(max_tokens=spec["output_len"], ignore_eos=True, seed=None)
llm.generate(spec["warmup"], params, use_tqdm=False)
start = time.perf_counter()
outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
elapsed = time.perf_counter() - start
tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
print("BENCH_RESULT " + json.dumps({"output_throughput": tokens / elapsed, "duration": elapsed,
      "total_output_tokens": tokens, "completed": len(outputs), "failed": 0}), flush=True)
"""


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int


# ---------------------------------------------------------------- servers


def wait_healthy(
    url: str,
    proc: subprocess.Popen,
    timeout: float = READY_TIMEOUT_S,
    name: str | None = None,
    tail: Callable[[], str] = lambda: "",
) -> None:
    """Wait for ``GET url/health`` to answer 200; raise if ``proc`` exits first or time
    runs out (``tail``: the server's log tail, for the message)."""
    name = name or url
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; log tail:\n{tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready after {timeout:.0f} s:\n{tail()}")


class Server:
    """A server process on 127.0.0.1:port, its log in a file; stopped with SIGTERM.

    It runs in a process group of its own so that it can be paused whole (SIGSTOP) while
    another server is measured: an idle server's processes (a polling engine core, OpenMP
    threads spinning) would otherwise take CPU from the one under test on a small machine."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path, env: dict):
        self.name, self.port = name, port
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        self.paused = False

    def pause(self) -> None:
        if self.proc.poll() is None and not self.paused:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_healthy(self.base_url, self.proc, timeout, self.name, self._tail)

    def stop(self) -> None:
        self.resume()  # a stopped process only acts on SIGTERM once continued
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the live processes in the server's process group."""
        return group_cpu_seconds(self.proc.pid)

    def _tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-3000:]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``
    (/proc/PID/stat; its threads included)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # fields[0] is the state: pgrp is the 5th field of stat
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def start_pagedllm(args: argparse.Namespace, model: str, log_dir: Path, name: str = "pagedllm",
                   port: int | None = None, flags: list[str] | None = None,
                   src: str | None = None) -> Server:  # fmt: skip
    port = args.port if port is None else port
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model,
               "--dtype", args.dtype, "--port", str(port), "--log-level", "warning",
               "--max-queued-requests", "4096", *args.pagedllm_arg, *(flags or [])]  # fmt: skip
    env = dict(os.environ)
    if src:  # a checkout's src/ (or a directory holding the package itself)
        path = Path(src) / "src" if (Path(src) / "src" / "pagedllm").is_dir() else Path(src)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return Server(name, command, port, log_dir, env)


def start_variants(args: argparse.Namespace, model: str, log_dir: Path) -> list[Server]:
    """One more pagedllm server per ``--variant``, on the ports after vLLM's."""
    servers = []
    for i, (name, flags) in enumerate(args.variant.items()):
        port, src = args.port + 2 + i, args.variant_src.get(name)
        servers.append(
            start_pagedllm(args, model, log_dir, f"pagedllm:{name}", port, shlex.split(flags), src)
        )
    return servers


def start_vllm(args: argparse.Namespace, model: str, log_dir: Path) -> Server:
    env = vllm_env()
    command = [args.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--dtype", args.dtype, "--port", str(args.port + 1), "--seed", "0",
               *args.vllm_arg]  # fmt: skip
    return Server("vllm", command, args.port + 1, log_dir, env)


# ---------------------------------------------------------------- clients


def vllm_client(args: argparse.Namespace, server: Server, model: str, work: Workload,
                seed: int) -> dict[str, Any]:  # fmt: skip
    """vLLM's benchmark client (the --vllm interpreter) on ``server``."""
    argv = ["--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(work.input_len), "--random-output-len", str(work.output_len),
            "--num-prompts", str(work.num_prompts), "--max-concurrency", str(work.max_concurrency),
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm"]  # fmt: skip
    return _child_result([args.vllm, "-c", VLLM_CLIENT, json.dumps(argv)])


def _child_result(command: list[str]) -> dict[str, Any]:
    """The child's BENCH_RESULT line, with ``cpu_s``: the CPU seconds it used."""
    before = _children_cpu_seconds()
    run = subprocess.run(command, capture_output=True, text=True)
    cpu_s = _children_cpu_seconds() - before
    for line in run.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return {**json.loads(line.removeprefix("BENCH_RESULT ")), "cpu_s": cpu_s}
    raise RuntimeError(f"{command[0]} failed ({run.returncode}):\n{run.stderr[-3000:]}")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def random_prompts(tokenizer: Any, work: Workload, seed: int, count: int) -> list[list[int]]:
    """Random token-id prompts of ``work.input_len`` tokens (no special tokens)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [[rng.choice(vocab) for _ in range(work.input_len)] for _ in range(count)]


async def _stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: TTFT, the gaps between content chunks, output tokens."""
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False}
        buffer = ""
        # Events end with a blank line; split on "\n" only (generated text may hold
        # U+2028 and the like, which str.splitlines would also split on).
        async for text in response.aiter_text():
            buffer += text
            *events, buffer = buffer.split("\n\n")
            for event in events:
                payload = event.removeprefix("data: ")
                if payload == "[DONE]" or not event.startswith("data: "):
                    continue
                data = json.loads(payload)
                if "error" in data:
                    return {"ok": False}
                if data.get("choices"):
                    times.append(time.perf_counter())
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
    if not times:
        return {"ok": False}
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"ok": True, "ttft": times[0] - start, "itls": gaps, "tokens": tokens}


async def httpx_client(
    server: Server, model: str, prompts: list[list[int]], work: Workload
) -> dict[str, Any]:
    """Our client with vLLM's request pattern: streamed completions, bounded concurrency."""
    limit = asyncio.Semaphore(work.max_concurrency)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=timeout) as client:

        async def one(prompt: list[int]) -> dict[str, Any]:
            body = {"model": model, "prompt": prompt, "max_tokens": work.output_len,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with limit:
                return await _stream_one(client, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    done = [r for r in results if r["ok"]]
    ttfts = [r["ttft"] * 1000 for r in done]
    itls = [g * 1000 for r in done for g in r["itls"]]
    tokens = sum(r["tokens"] for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration": duration,
        "total_output_tokens": tokens, "output_throughput": tokens / duration,
        "mean_ttft_ms": _mean(ttfts), "p99_ttft_ms": _p99(ttfts),
        "mean_itl_ms": _mean(itls), "p99_itl_ms": _p99(itls),
    }  # fmt: skip


def offline(args: argparse.Namespace, model: str, work: Workload, prompts: list[list[int]],
            warmup: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    spec = {"model": model, "dtype": args.dtype, "max_concurrency": work.max_concurrency,
            "output_len": work.output_len, "prompts": prompts, "warmup": warmup}  # fmt: skip
    # The prompts go through a file: thousands of token ids overflow a command line.
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(spec, file)
        file.flush()
        return _child_result([sys.executable, "-c", OFFLINE, file.name])


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# ---------------------------------------------------------------- rounds and the report


def run_rounds(args: argparse.Namespace, model: str, work: Workload, log_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    results: dict[str, list[dict[str, Any]]] = {"pagedllm": [], "vllm": []}
    results.update({f"pagedllm:{name}": [] for name in args.variant})
    results["offline"] = []
    with ExitStack() as stack:
        servers = [start_pagedllm(args, model, log_dir)]
        if args.vllm and not args.no_vllm_server:
            servers.append(start_vllm(args, model, log_dir))
        servers += start_variants(args, model, log_dir)
        for server in servers:
            stack.callback(server.stop)
        for server in servers:
            server.wait_ready()
        if args.client_nice:
            # This thread's nice value (Linux: per thread), inherited by the vLLM client;
            # the servers started before it keep theirs.
            os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
        warm = Workload(work.input_len, 16, min(8, work.num_prompts), work.max_concurrency)
        for server in servers:  # first requests pay one-time costs
            drive(args, server, model, tokenizer, warm, seed=10_000)
            server.pause()
        for r in range(args.rounds):
            seed = args.seed + r
            # By the seed's parity: rounds split across runs (--seed r --rounds 1) alternate too.
            order = servers if seed % 2 == 0 else servers[::-1]
            for server in order:  # only the server under test runs; the others are paused
                server.resume()
                result = drive(args, server, model, tokenizer, work, seed)
                server.pause()
                results[server.name].append(result)
                _log_round(r, server.name, result)
            if not args.no_offline:
                prompts = random_prompts(tokenizer, work, seed, work.num_prompts)
                warmup = random_prompts(tokenizer, warm, 10_000, warm.num_prompts)
                result = offline(args, model, work, prompts, warmup)
                results["offline"].append(result)
                _log_round(r, "offline", result)
    return {k: v for k, v in results.items() if v}


def drive(args: argparse.Namespace, server: Server, model: str, tokenizer: Any, work: Workload,
          seed: int) -> dict[str, Any]:  # fmt: skip
    """One client run on ``server``, with the cores the client and the server used."""
    server_cpu = server.cpu_seconds()
    if args.workload == "json-schema":
        bodies = json_schema_workload.requests(model, work.num_prompts, work.output_len, seed)
        own_cpu = time.process_time()
        result = asyncio.run(
            json_schema_workload.run(server.base_url, bodies, work.max_concurrency)
        )
        result["cpu_s"] = time.process_time() - own_cpu
    elif args.vllm:
        result = vllm_client(args, server, model, work, seed)
    else:
        prompts = random_prompts(tokenizer, work, seed, work.num_prompts)
        own_cpu = time.process_time()
        result = asyncio.run(httpx_client(server, model, prompts, work))
        result["cpu_s"] = time.process_time() - own_cpu
    duration = result.get("duration") or 0.0
    if duration > 0:
        result["client_cores"] = result["cpu_s"] / duration
        result["server_cores"] = (server.cpu_seconds() - server_cpu) / duration
    return result


def _log_round(r: int, name: str, result: dict[str, Any]) -> None:
    if "invalid" in result:  # the json-schema workload
        print(f"  round {r} {name:14s} invalid {result['invalid']} (not cut "
              f"{result['invalid_uncut']}) {result['invalid_examples']} "
              f"errors {result['errors']}", file=sys.stderr)  # fmt: skip
        timing = f"latency {result.get('mean_latency_ms') or 0:8.1f} ms"
    else:
        timing = (f"ttft {result.get('mean_ttft_ms') or 0:8.1f} ms  "
                  f"itl {result.get('mean_itl_ms') or 0:6.1f} ms")  # fmt: skip
    print(f"  round {r} {name:14s} {result['output_throughput']:8.1f} tok/s  {timing}  failed {result.get('failed')}  client {result.get('client_cores') or 0:.2f} cores"
          f"  server {result.get('server_cores') or 0:.2f} cores", file=sys.stderr,
          flush=True)  # fmt: skip


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians with (min, max) per engine and metric; ratios as medians of per-round ratios."""
    summary: dict[str, Any] = {}
    for name, rounds in results.items():
        entry: dict[str, Any] = {"rounds": len(rounds)}
        for metric in (*METRICS, *CPU_METRICS, "failed", *STRUCTURED_METRICS):
            values = [r[metric] for r in rounds if r.get(metric) is not None]
            if values:
                entry[metric] = {"median": statistics.median(values), "min": min(values),
                                 "max": max(values)}  # fmt: skip
        summary[name] = entry
    ratios: dict[str, Any] = {}
    variants = [name for name in results if name.startswith("pagedllm:")]
    if "vllm" in results:
        for name in ("pagedllm", *variants):
            prefix = "" if name == "pagedllm" else f"{name.removeprefix('pagedllm:')}_"
            for metric in METRICS:
                ratios[f"{prefix}{metric}_vs_vllm"] = _ratio(results[name], results["vllm"], metric)
    for name in variants:
        for metric in METRICS:
            ratios[f"{name.removeprefix('pagedllm:')}_{metric}_vs_pagedllm"] = _ratio(
                results[name], results["pagedllm"], metric
            )
    if "offline" in results:
        ratios["output_throughput_vs_offline"] = _ratio(
            results["pagedllm"], results["offline"], "output_throughput"
        )
    summary["ratios"] = ratios
    return summary


def _ratio(ours: list[dict], theirs: list[dict], metric: str) -> dict[str, float] | None:
    values = [a[metric] / b[metric] for a, b in zip(ours, theirs, strict=False)
              if a.get(metric) and b.get(metric)]  # fmt: skip
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_table(summary: dict[str, Any], work: Workload, args: argparse.Namespace) -> None:
    if args.workload == "json-schema":
        what = f"JSON Schema chats (8 schemas) of at most {work.output_len} tokens"
        header = ("engine", "output tok/s", "mean latency ms", "client cores", "server cores",
                  "failed", "invalid", "cut by max_tokens", "invalid, not cut")  # fmt: skip
        metrics: tuple[str, ...] = ("output_throughput", "mean_latency_ms", *CPU_METRICS,
                                    "failed", "invalid", "truncated", "invalid_uncut")  # fmt: skip
    else:
        what = f"random {work.input_len} in / {work.output_len} out"
        header = ("engine", "output tok/s", "mean TTFT ms", "p99 TTFT ms", "mean ITL ms",
                  "p99 ITL ms", "client cores", "server cores", "failed")  # fmt: skip
        metrics = (*METRICS, *CPU_METRICS, "failed")
    print(f"serve_vs_vllm: {args.model} {args.dtype}, {what}, {work.num_prompts} prompts, "
          f"concurrency {work.max_concurrency}, {args.rounds} rounds; CPU: {cpu_info().label}, "
          f"{os.cpu_count()} cores")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for name, entry in summary.items():
        if name == "ratios":
            continue
        cells = [name] + [_cell(entry.get(m)) for m in metrics]
        print("| " + " | ".join(cells) + " |")
    for key, value in summary["ratios"].items():
        if value is not None:
            print(f"  pagedllm {key}: {value['median']:.2f} "
                  f"(rounds {value['min']:.2f}-{value['max']:.2f})")  # fmt: skip


def _cell(entry: dict[str, float] | None) -> str:
    if entry is None:
        return "-"
    digits = 2 if abs(entry["median"]) < 10 else 1  # cores and failures: two decimals
    return f"{entry['median']:.{digits}f} ({entry['min']:.{digits}f}-{entry['max']:.{digits}f})"


def resolve_model(name: str) -> str:
    if name == "default":
        from pagedllm.model.default_model import ensure_default_model

        return str(ensure_default_model())
    return str(Path(name).expanduser().resolve())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="HF directory or 'default'")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", choices=WORKLOADS, default="random",
                        help="random token prompts (vLLM's client with --vllm), or chats "
                        "held to JSON Schemas (our client for every server)")  # fmt: skip
    parser.add_argument("--vllm", metavar="PYTHON", help="interpreter with vLLM installed")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="round r uses seed + r")
    parser.add_argument("--port", type=int, default=8710, help="pagedllm's; vLLM's is +1")
    parser.add_argument("--no-offline", action="store_true", help="skip LLM.generate")
    parser.add_argument("--client-nice", type=int, default=0,
                        help="the client's nice value (a diagnostic; see above)")  # fmt: skip
    parser.add_argument("--pagedllm-arg", action="append", default=[],
                        help="an extra flag for pagedllm serve (repeat)")  # fmt: skip
    parser.add_argument("--vllm-arg", action="append", default=[],
                        help="an extra flag for vLLM's server (repeat)")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="another pagedllm server with these extra flags (repeat)")  # fmt: skip
    parser.add_argument("--variant-src", action="append", default=[], metavar="NAME=DIR",
                        help="run variant NAME from the checkout DIR (its src/)")  # fmt: skip
    parser.add_argument("--no-vllm-server", action="store_true",
                        help="with --vllm: its client only, no vLLM server")  # fmt: skip
    args = parser.parse_args(argv)
    args.variant = _named(parser, args.variant, "--variant")
    args.variant_src = _named(parser, args.variant_src, "--variant-src")
    unknown = set(args.variant_src) - set(args.variant)
    if unknown:
        parser.error(f"--variant-src names no --variant: {', '.join(sorted(unknown))}")
    if args.no_vllm_server and not args.vllm:
        parser.error("--no-vllm-server needs --vllm (its client)")
    if args.rounds < 1 or args.num_prompts < 1 or args.max_concurrency < 1:
        parser.error("--rounds, --num-prompts and --max-concurrency must be positive")
    if args.workload == "json-schema":
        if args.no_vllm_server:
            parser.error("--no-vllm-server: the json-schema workload uses our client only")
        args.no_offline = True  # the offline timing is of the random workload
    return args


def _named(parser: argparse.ArgumentParser, items: list[str], flag: str) -> dict[str, str]:
    named: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or name in named:
            parser.error(f"{flag} takes NAME=VALUE with distinct names, got {item!r}")
        named[name] = value
    return named


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Workload(args.input_len, args.output_len, args.num_prompts, args.max_concurrency)
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as log_dir:
        results = run_rounds(args, model, work, Path(log_dir))
    summary = summarize(results)
    print_table(summary, work, args)
    failed = sum(r.get("failed") or 0 for rounds in results.values() for r in rounds)
    # A grammar that let an invalid output through (one not cut by max_tokens) fails ours.
    unheld = sum(r.get("invalid_uncut") or 0 for name, rounds in results.items()
                 if name.startswith("pagedllm") for r in rounds)  # fmt: skip
    print(json.dumps({"workload": asdict(work), "kind": args.workload, "model": args.model,
                      "dtype": args.dtype, "cpu": cpu_info().label, "summary": summary,
                      "rounds": results}))  # fmt: skip
    return 1 if failed or unheld else 0


if __name__ == "__main__":
    sys.exit(main())
