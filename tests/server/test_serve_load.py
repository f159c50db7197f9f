"""benchmarks/serve_load.py, briefly: a few clients, hang-ups, invalid requests, preemption."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def test_serve_load_quick_run_loses_and_leaks_nothing(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("serve_load", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "serve_load", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    status = module.main(["--clients", "6", "--duration", "2", "--num-blocks", "40",
                          "--disconnect-share", "0.3", "--invalid-share", "0.2"])  # fmt: skip
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert status == 0, out
    assert result["ok"] and result["lost"] == 0 and result["leaked_blocks"] == 0
    assert result["http_5xx"] == 0 and result["failed"] == 0
    assert result["completed"] > 0 and result["aborted"] > 0 and result["rejected_invalid"] > 0
    assert result["preemptions"]["recompute"] + result["preemptions"]["swap"] > 0
