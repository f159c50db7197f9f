"""Single-stream decode speed and memory of the default model (SmolLM2-135M-Instruct, a Q4_1
GGUF) with its linears kept quantized (``LLM(model=FILE.gguf)``) against the float model
converted from the same file (``LLM(model="default")``: every weight dequantised).

Each configuration runs in a fresh child process (so that its RSS is its own), in alternated
rounds; the figures are medians over the rounds (each round's speed: the median of
``REPEATS`` generations in its child). Decode tok/s: (output tokens - 1) over the time after
the first token (a one-token generation of the same prompt timed just before), greedy, one
request, ``ignore_eos``.

    .venv/bin/python benchmarks/quant_decode.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CONFIGS = ("float", "quantized")
# Timed generations in each child; the child reports their median.
REPEATS = 3


def child(config: str, prompt_tokens: int, output_tokens: int, kv_mib: int) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.default_model import default_gguf_path

    model = "default" if config == "float" else str(default_gguf_path())
    # No prefix cache: every call computes its prompt, as the first one did.
    llm = LLM(
        model=model, kv_cache_memory=kv_mib << 20, max_num_seqs=1, enable_prefix_caching=False
    )
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 40
    prompt = llm.get_tokenizer().encode(text)[:prompt_tokens]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    request = [{"prompt_token_ids": prompt}]
    llm.generate(request, full, use_tqdm=False)  # warm-up
    speeds, first_token_s = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        llm.generate(request, first, use_tqdm=False)
        prompt_s = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate(request, full, use_tqdm=False)
        total_s = time.perf_counter() - start
        speeds.append((len(out[0].outputs[0].token_ids) - 1) / (total_s - prompt_s))
        first_token_s.append(prompt_s)
    tokens = out[0].outputs[0].token_ids
    routes = llm.engine.routes
    return {
        "decode_tok_s": statistics.median(speeds),
        "first_token_ms": statistics.median(first_token_s) * 1e3,
        "rss_mib": _status("VmRSS") / 1024,
        "peak_rss_mib": _status("VmHWM") / 1024,
        "tokens": list(tokens[:16]),
        "linears": getattr(routes, "linears", ""),
    }


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--kv-mib", type=int, default=64)
    parser.add_argument("--child", choices=CONFIGS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args.prompt_tokens, args.output_tokens, args.kv_mib)
        print(json.dumps(result))
        return
    from pagedllm.kernels.probe import cpu_info

    print(f"CPU: {cpu_info().label}")
    results: dict[str, list[dict]] = {config: [] for config in CONFIGS}
    for round_index in range(args.rounds):
        order = CONFIGS if round_index % 2 == 0 else tuple(reversed(CONFIGS))
        for config in order:
            command = [sys.executable, __file__, "--child", config]
            command += ["--prompt-tokens", str(args.prompt_tokens)]
            command += ["--output-tokens", str(args.output_tokens), "--kv-mib", str(args.kv_mib)]
            line = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            result = json.loads(line.strip().splitlines()[-1])
            results[config].append(result)
            print(round_index, config, {k: v for k, v in result.items() if k != "tokens"})
    for config, rounds in results.items():
        speeds = [r["decode_tok_s"] for r in rounds]
        rss = [r["rss_mib"] for r in rounds]
        first_ms = statistics.median(r["first_token_ms"] for r in rounds)
        print(
            f"{config}: decode {statistics.median(speeds):.1f} tok/s "
            f"(rounds {', '.join(f'{s:.1f}' for s in speeds)}), "
            f"first token {first_ms:.1f} ms, RSS {statistics.median(rss):.0f} MiB (peak {max(r['peak_rss_mib'] for r in rounds):.0f})"
        )
    first = [r["tokens"] for r in results["float"]][0]
    same = sum(a == b for a, b in zip(first, results["quantized"][0]["tokens"], strict=False))
    print(f"first 16 greedy tokens equal: {same} of {len(first)}")


if __name__ == "__main__":
    main()
