"""benchmarks/throughput.py: engines taking turns over rounds, and the vLLM child's protocol
(driven here through a stand-in `vllm` package, so no vLLM install is needed)."""

import sys
import textwrap
from pathlib import Path

import pytest
from test_benchmark_floor import load_throughput

FAKE_VLLM = textwrap.dedent(
    """
    import os, time

    class SamplingParams:
        def __init__(self, max_tokens, **kwargs):
            self.max_tokens = max_tokens

    class _Completion:
        def __init__(self, n):
            self.token_ids = [0] * n

    class _Output:
        def __init__(self, n):
            self.outputs = [_Completion(n)]

    class LLM:
        def __init__(self, model, dtype, seed):
            if os.environ.get("FAKE_VLLM_FAIL"):
                raise SystemExit("no such model: " + model)
            self.cached = set()

        def reset_prefix_cache(self):
            self.cached.clear()
            return True

        def generate(self, items, params, use_tqdm):
            prompts = tuple(tuple(item["prompt_token_ids"]) for item in items)
            if prompts in self.cached:
                raise AssertionError("these prompts would hit the last round's prefix cache")
            self.cached.add(prompts)
            time.sleep(0.01)
            short = int(os.environ.get("FAKE_VLLM_SHORT", "0"))
            return [_Output(p.max_tokens - short) for p in params]
    """
)


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_engines_take_turns_reversing_every_other_round():
    throughput = load_throughput()
    calls = []

    def engine(name, seconds):
        def run():
            calls.append(name)
            return seconds.pop(0)

        return throughput.Started(name, run, {})

    engines = [engine("a", [1.0, 2.0, 3.0]), engine("b", [4.0, 5.0, 6.0])]
    times = throughput.run_rounds(engines, 3, wait=lambda: calls.append("wait"))
    assert calls == ["wait", "a", "wait", "b", "wait", "b", "wait", "a", "wait", "a", "wait", "b"]
    assert times == {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0]}


def test_summary_is_the_median_round_and_ratios_pair_rounds():
    throughput = load_throughput()
    work = throughput.Workload([[1, 2]], [10])
    started = throughput.Started("x", lambda: 0.0, {"startup_s": 1.0})
    res = throughput.summarize(work, started, [2.0, 1.0, 5.0])
    assert res["elapsed_s"] == 2.0 and res["output_tok_per_s"] == 5.0
    assert res["rounds_output_tok_per_s"] == [5.0, 10.0, 2.0]
    assert res["startup_s"] == 1.0
    # pagedllm took 1 s then 2 s; the other 3 s then 2 s: 3x, then 1x.
    assert throughput.round_ratios([1.0, 2.0], [3.0, 2.0]) == [3.0, 1.0]


def test_vllm_child_times_one_generate_per_run_from_an_empty_prefix_cache(fake_vllm: Path):
    throughput = load_throughput()
    work = throughput.Workload([[1, 2, 3], [4]], [3, 2])
    engine = throughput.start_vllm(sys.executable, fake_vllm, "bfloat16", work)
    try:
        times = [engine.run(), engine.run()]
    finally:
        engine.close()
    assert all(0.0 < t < 5.0 for t in times)
    assert engine.extra["startup_s"] >= 0.0


@pytest.mark.parametrize("env", ["FAKE_VLLM_FAIL", "FAKE_VLLM_SHORT"])
def test_vllm_child_failures_carry_its_log(fake_vllm: Path, monkeypatch, env):
    throughput = load_throughput()
    monkeypatch.setenv(env, "1")
    work = throughput.Workload([[1, 2, 3]], [3])
    with pytest.raises(RuntimeError, match="vLLM run failed") as info:
        engine = throughput.start_vllm(sys.executable, fake_vllm, "bfloat16", work)
        engine.run()
    expected = "no such model" if env == "FAKE_VLLM_FAIL" else "AssertionError"
    assert expected in str(info.value)


def test_settle_waits_until_an_interval_is_quiet():
    throughput = load_throughput()
    # Cumulative (busy, total) jiffies: 50% busy, then 40%, then 5%.
    readings = iter([(0, 0), (50, 100), (90, 200), (95, 300), (200, 400)])
    slept = []
    waited = throughput.settle(lambda: next(readings), slept.append, interval=0.5)
    assert waited == 1.5 and slept == [0.5, 0.5, 0.5]


def test_settle_gives_up_at_its_limit_and_without_proc_stat():
    throughput = load_throughput()
    busy = iter((100 * i, 100 * i) for i in range(100))
    assert throughput.settle(lambda: next(busy), lambda s: None, interval=1.0, limit=4.0) == 4.0
    assert throughput.settle(lambda: None, lambda s: None, interval=0.5) == 0.5
