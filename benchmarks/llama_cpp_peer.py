"""llama.cpp as a benchmark-only peer: its ``llama-bench`` on the same GGUF (prompt and
decode tok/s), and a ``llama-server`` that other benchmarks drive over its OpenAI API.

llama.cpp is never a dependency. Build it once from the ``llama-cpp-python`` 0.3.36 sdist's
vendored tree (about 5 minutes on 2 cores)::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d peers
    tar xzf peers/llama_cpp_python-0.3.36.tar.gz -C peers
    cd peers/llama_cpp_python-0.3.36/vendor/llama.cpp
    # GCC 12 with AMX: ggml-cpu/amx/mmq.cpp's `_tile_loadconfig(&tc);` faults; load the
    # whole struct instead: asm volatile("ldtilecfg %0" :: "m"(tc));
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-bench llama-batched-bench llama-server

Then pass ``build/bin`` as ``--llama-cpp DIR`` (here or to a benchmark that takes it)::

    .venv/bin/python benchmarks/llama_cpp_peer.py --llama-cpp DIR --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def find_tool(directory: str | Path, name: str) -> Path:
    """``directory/name``, an executable of a llama.cpp build; ``ValueError`` naming what
    is missing otherwise."""
    tool = Path(directory) / name
    if not tool.is_file():
        raise ValueError(f"--llama-cpp {directory}: no {name} there (build it: see {__file__})")
    return tool


def gguf_path(model: str) -> Path:
    """The GGUF of a named model ("default", "qwen2.5-coder-0.5b", fetched on first use)
    or a file path."""
    if model == "default":
        from pagedllm.model.default_model import default_gguf_path, ensure_default_model

        ensure_default_model()
        return default_gguf_path()
    if model == "qwen2.5-coder-0.5b":
        from pagedllm.model.qwen_coder_model import GGUF_NAME, ensure_qwen_coder_model

        return ensure_qwen_coder_model() / GGUF_NAME
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"--model {model}: not a named model nor a GGUF file")
    return path


def parse_bench(records: Sequence[dict]) -> dict:
    """llama-bench's JSON records as {"prompt_tok_per_s", "decode_tok_per_s", ...}: the
    prompt test is the record with n_gen 0, the decode test the one with n_prompt 0."""
    result: dict = {}
    for record in records:
        key = "decode" if record["n_prompt"] == 0 else "prompt"
        if record["n_gen"] and record["n_prompt"]:
            key = "prompt_and_decode"
        result[f"{key}_tok_per_s"] = round(record["avg_ts"], 2)
        result[f"{key}_stddev"] = round(record["stddev_ts"], 2)
    if records:
        result["build_commit"] = records[0]["build_commit"]
        result["model_type"] = records[0]["model_type"]
        result["model_bytes"] = records[0]["model_size"]
        result["threads"] = records[0]["n_threads"]
    return result


def llama_bench(
    directory: str | Path,
    gguf: Path,
    prompt_tokens: int,
    gen_tokens: int,
    threads: int = 2,
    repetitions: int = 3,
) -> dict:
    """One llama-bench run: a ``prompt_tokens`` prompt test and a ``gen_tokens`` decode
    test, each ``repetitions`` times (llama-bench reports their mean and spread)."""
    command = [
        str(find_tool(directory, "llama-bench")),
        *("-m", str(gguf), "-p", str(prompt_tokens), "-n", str(gen_tokens)),
        *("-t", str(threads), "-r", str(repetitions), "-o", "json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-500:]}")
    return parse_bench(json.loads(done.stdout))


@contextmanager
def llama_server(
    directory: str | Path,
    gguf: Path,
    port: int,
    *,
    threads: int = 2,
    parallel: int = 1,
    context: int = 8192,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
) -> Iterator[str]:
    """A llama-server on ``127.0.0.1:port`` serving ``gguf`` (``parallel`` slots sharing
    ``context`` tokens; ``extra_args``, e.g. ``("--spec-type", "ngram-simple")``); yields
    its OpenAI base URL once ``/health`` answers, and stops it after."""
    command = [
        str(find_tool(directory, "llama-server")),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-np", str(parallel), "-c", str(context), "--no-webui"),
        *extra_args,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(process, f"http://127.0.0.1:{port}/health", ready_timeout_s)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"llama-server exited ({process.returncode}): {error[-500:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass  # not listening yet, or still loading (503)
        time.sleep(0.2)
    raise RuntimeError(f"llama-server did not answer {url} within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, metavar="DIR", help="llama.cpp build/bin")
    parser.add_argument("--model", default="default", help="default | qwen2.5-coder-0.5b | FILE")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args(argv)
    gguf = gguf_path(args.model)
    result = llama_bench(
        args.llama_cpp, gguf, args.prompt_tokens, args.gen_tokens, args.threads, args.repetitions
    )
    print(f"llama.cpp {result['build_commit']}  {result['model_type']}  {gguf.name}")
    print(f"{'test':<24}{'tok/s':>10}{'+/-':>8}")
    for key in ("prompt", "decode"):
        tokens = args.prompt_tokens if key == "prompt" else args.gen_tokens
        name = f"{key} ({tokens} tokens)"
        print(f"{name:<24}{result[f'{key}_tok_per_s']:>10.1f}{result[f'{key}_stddev']:>8.1f}")
    print(json.dumps({"llama.cpp": {**result, "gguf": gguf.name}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
