"""The cache advisor's speed: reading a 12,000-request token-id trace, and tokenizing + hashing.

    read_s        parse a JSONL token-id trace of --num-requests requests (read_log)
    report_s      read + every figure of `pagedllm cache-report` (unbounded hits, the
                  replay through KVCacheManager, divergences described, costs)
    tokenize_hash_tok_s  chat requests rendered by the default model's chat template,
                  tokenized in one batch and hashed into the engine's block chain
                  (tokens per second; needs the default model's tokenizer)

Wall times of this process, medians of --rounds rounds with the spread (min..max). The
trace is seeded: --templates system prompts of 300-1,500 tokens, each request one of them
with a varying number planted in a third of the templates, and its own 50-500-token tail.
Prints a table, then one JSON line.

    .venv/bin/python benchmarks/cache_report.py [--num-requests 12000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagedllm.core.hashing import hash_request_blocks
from pagedllm.planner.cache_advisor import analyze, build_report
from pagedllm.planner.cachelog import read_log
from pagedllm.planner.prices import load_profiles


def write_trace(path: Path, num_requests: int, num_templates: int, seed: int) -> int:
    rng = random.Random(seed)
    templates = [
        [rng.randrange(100, 49_000) for _ in range(rng.randint(300, 1500))]
        for _ in range(num_templates)
    ]
    total = 0
    with path.open("w") as f:
        for _ in range(num_requests):
            t = rng.randrange(num_templates)
            head = list(templates[t])
            if t % 3 == 0:  # a varying number 20 tokens in
                head[20:23] = [rng.randrange(15, 25) for _ in range(3)]
            tail = [rng.randrange(100, 49_000) for _ in range(rng.randint(50, 500))]
            tokens = head + tail
            total += len(tokens)
            f.write(json.dumps({"prompt_token_ids": tokens}) + "\n")
    return total


class DigitDecoder:
    """A stand-in tokenizer for the synthetic ids (decoding shows the ids)."""

    def decode(self, token_ids):
        return " ".join(map(str, token_ids))

    def encode_prompts(self, texts):
        raise NotImplementedError

    def encode_chats(self, conversations):
        raise NotImplementedError


def time_report(path: Path) -> tuple[float, float]:
    start = time.perf_counter()
    log = read_log(path)
    read = time.perf_counter() - start
    analysis = analyze(log, DigitDecoder(), block_size=16, num_blocks=65_536)
    build_report(analysis, load_profiles())
    return read, time.perf_counter() - start


def time_tokenize_hash(num_requests: int) -> tuple[float, int] | None:
    try:
        from pagedllm.model.tokenizer import load_text_tokenizer

        tokenizer = load_text_tokenizer("default")
        tokenizer.encode_chats([[{"role": "user", "content": "warm up"}]])
    except Exception as exc:  # no default model here: say so, measure the rest
        print(f"tokenize+hash skipped: {exc}", file=sys.stderr)
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.planner.cache_corpus import make_corpus, messages

    chats = [messages(p) for p in make_corpus(num_requests, seed=11)]
    start = time.perf_counter()
    ids = tokenizer.encode_chats(chats)
    for tokens in ids:
        hash_request_blocks(tokens, 16)
    return time.perf_counter() - start, sum(map(len, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=12_000)
    parser.add_argument("--templates", type=int, default=40)
    parser.add_argument("--chat-requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        num_tokens = write_trace(path, args.num_requests, args.templates, args.seed)
        reads, reports, rates = [], [], []
        for _ in range(args.rounds):
            read, report = time_report(path)
            reads.append(read)
            reports.append(report)
            measured = time_tokenize_hash(args.chat_requests)
            if measured:
                rates.append(measured[1] / measured[0])
    result = {
        "num_requests": args.num_requests,
        "num_tokens": num_tokens,
        "read_s": statistics.median(reads),
        "read_s_range": [min(reads), max(reads)],
        "report_s": statistics.median(reports),
        "report_s_range": [min(reports), max(reports)],
        "tokenize_hash_tok_s": statistics.median(rates) if rates else None,
        "tokenize_hash_tok_s_range": [min(rates), max(rates)] if rates else None,
        "rounds": args.rounds,
    }
    print(f"{'figure':<28} {'median':>12} {'range':>24}")
    print(f"{'read (s)':<28} {result['read_s']:>12.2f} {_range(reads, '.2f'):>24}")
    print(f"{'read + report (s)':<28} {result['report_s']:>12.2f} {_range(reports, '.2f'):>24}")
    if rates:
        print(
            f"{'tokenize + hash (tok/s)':<28} {result['tokenize_hash_tok_s']:>12,.0f} "
            f"{_range(rates, ',.0f'):>24}"
        )
    print(json.dumps(result))


def _range(values: list[float], spec: str) -> str:
    return f"{format(min(values), spec)}..{format(max(values), spec)}"


if __name__ == "__main__":
    main()
