"""benchmarks/llama_cpp_peer.py against stand-in llama.cpp tools: llama-bench's JSON read
into prompt and decode tok/s, llama-server waited on until healthy and stopped after, and a
missing build named in the error."""

from __future__ import annotations

import json
import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from pagedllm.util.net import free_port

from .test_benchmarks_smoke import last_json, load


def record(n_prompt: int, n_gen: int, tok_s: float) -> dict:
    return {
        "build_commit": "0c1e570",
        "model_type": "llama 256M Q4_1",
        "model_size": 96576768,
        "n_threads": 2,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "avg_ts": tok_s,
        "stddev_ts": 0.5,
    }


def write_tool(directory: Path, name: str, body: str) -> Path:
    tool = directory / name
    tool.write_text(f"#!{sys.executable}\n{body}")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


def test_bench_records_become_prompt_and_decode_rates(tmp_path, capsys) -> None:
    records = [record(256, 0, 141.25), record(0, 128, 43.125)]
    write_tool(
        tmp_path,
        "llama-bench",
        "import sys, json\n"
        "args = sys.argv[1:]\n"
        "assert args[args.index('-p') + 1] == '256' and args[args.index('-t') + 1] == '2'\n"
        f"print(json.dumps({records!r}))\n",
    )
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    peer = load("llama_cpp_peer")
    assert peer.main(["--llama-cpp", str(tmp_path), "--model", str(gguf)]) == 0
    result = last_json(capsys)["llama.cpp"]
    assert result["prompt_tok_per_s"] == 141.25
    assert result["decode_tok_per_s"] == 43.12
    assert result["model_bytes"] == 96576768 and result["gguf"] == "m.gguf"


def test_a_missing_build_is_named(tmp_path) -> None:
    peer = load("llama_cpp_peer")
    with pytest.raises(ValueError, match="no llama-bench there"):
        peer.llama_bench(tmp_path, tmp_path / "m.gguf", 8, 8)


SERVER = """\
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
assert "--spec-type" in sys.argv

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_the_server_is_up_inside_the_block_and_gone_after(tmp_path) -> None:
    write_tool(tmp_path, "llama-server", SERVER)
    peer = load("llama_cpp_peer")
    port = free_port()
    extra = ("--spec-type", "ngram-simple")
    with peer.llama_server(tmp_path, tmp_path / "m.gguf", port, extra_args=extra) as url:
        assert url == f"http://127.0.0.1:{port}/v1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as answer:
            assert json.loads(answer.read()) == {"status": "ok"}
    with pytest.raises(OSError):  # stopped: nothing listens there any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_server_that_exits_is_reported(tmp_path) -> None:
    write_tool(tmp_path, "llama-server", "import sys\nsys.stderr.write('bad model')\nsys.exit(3)\n")
    peer = load("llama_cpp_peer")
    with (
        pytest.raises(RuntimeError, match="exited \\(3\\): bad model"),
        peer.llama_server(tmp_path, tmp_path / "m.gguf", free_port()),
    ):
        pass


COMPLETING_SERVER = """\
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
assert sys.argv[sys.argv.index("--spec-type") + 1] == "ngram-simple"

class Completions(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert self.path == "/completion" and body["temperature"] == 0.0
        answer = json.dumps({"tokens": [7] * body["n_predict"]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", port), Completions).serve_forever()
"""


def test_spec_decode_takes_llama_cpp_as_a_mode(tmp_path, capsys) -> None:
    from pagedllm.testing import make_tiny_checkpoint

    write_tool(tmp_path, "llama-server", COMPLETING_SERVER)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=3)
    args = ["--model", str(model), "--dtype", "float32", "--concurrency", "2"]
    args += ["--rounds", "1", "--max-tokens", "5", "--source-lines", "12", "--modes", "off"]
    args += ["--max-model-len", "1024", "--kv-mib", "64", "--num-threads", "1"]
    args += ["--workloads", "code-edit", "--llama-cpp", str(tmp_path)]
    args += ["--llama-model", str(tmp_path / "m.gguf")]
    assert load("spec_decode").main(args) == 0
    cell = last_json(capsys)["cells"]["code-edit c=2"]
    assert set(cell) == {"off", "llama.cpp"}
    assert cell["llama.cpp"]["output_tokens"] == 2 * 5
    assert cell["llama.cpp"]["ratio"] > 0 and "greedy_identical" not in cell["llama.cpp"]


BATCHED_BENCH = """
import json, sys
args = sys.argv[1:]
value = lambda flag: int(args[args.index(flag) + 1])
pp, tg, pl = value("-npp"), value("-ntg"), value("-npl")
assert value("-c") >= pl * (pp + tg) and args[args.index("--output-format") + 1] == "jsonl"
t = 2.0
print("main: noise before the record")
print(json.dumps({"pp": pp, "tg": tg, "pl": pl, "t_pp": 0.5, "speed_pp": pl * pp / 0.5,
                  "t_tg": 1.5, "speed_tg": pl * tg / 1.5, "t": t, "speed": pl * (pp + tg) / t}))
"""


def test_batched_peer_compares_a_whole_batch_with_llama_batched_bench(tmp_path, capsys) -> None:
    from pagedllm.testing import make_tiny_checkpoint

    write_tool(tmp_path, "llama-batched-bench", BATCHED_BENCH)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=3)
    args = ["--model", str(model), "--llama-cpp", str(tmp_path), "--rounds", "2"]
    args += ["--sequences", "3", "--prompt-tokens", "20", "--gen-tokens", "6"]
    args += ["--llama-model", str(tmp_path / "m.gguf")]
    assert load("batched_peer").main(args) == 0
    result = last_json(capsys)
    assert result["llama.cpp"]["output_tok_s"] == 3 * 6 / 2.0
    assert result["pagedllm"]["output_tok_s"] > 0
    ours, theirs = result["pagedllm"]["output_tok_s"], result["llama.cpp"]["output_tok_s"]
    assert len(result["ratio"]["rounds"]) == 2
    assert min(result["ratio"]["rounds"]) <= ours / theirs <= max(result["ratio"]["rounds"])
