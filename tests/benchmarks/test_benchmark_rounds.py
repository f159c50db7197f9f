"""benchmarks/throughput.py: engines taking turns over rounds, and the vLLM child's protocol
(driven here through a stand-in `vllm` package, so no vLLM install is needed)."""

import os
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest

from .test_benchmark_floor import load_throughput

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
            if os.environ.get("FAKE_VLLM_ENV_LOG"):
                with open(os.environ["FAKE_VLLM_ENV_LOG"], "w") as f:
                    f.write(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "unset"))
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
            log = os.environ.get("FAKE_VLLM_LOG")
            if log:
                with open(log, "a") as f:
                    f.write(" ".join(str(p.max_tokens) for p in params) + "\\n")
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


def test_vllm_child_times_the_prompt_phase_with_one_token_each(
    fake_vllm: Path, monkeypatch: pytest.MonkeyPatch
):
    throughput = load_throughput()
    log = fake_vllm / "generates.txt"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    work = throughput.Workload([[1, 2, 3], [4]], [3, 2])
    engine = throughput.start_vllm(sys.executable, fake_vllm, "bfloat16", work)
    try:
        engine.run_prompts()
        engine.run()
    finally:
        engine.close()
    warmup = " ".join(map(str, throughput.warmup_workload().max_tokens))
    assert log.read_text().splitlines() == [warmup, "1 1", "3 2"]


@pytest.mark.parametrize("preset", [None, "0"])
def test_vllm_child_gets_every_core_unless_told(fake_vllm: Path, monkeypatch, preset):
    throughput = load_throughput()
    log = fake_vllm / "env.txt"
    monkeypatch.setenv("FAKE_VLLM_ENV_LOG", str(log))
    if preset is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", preset)
    work = throughput.Workload([[1, 2, 3]], [3])
    engine = throughput.start_vllm(sys.executable, fake_vllm, "bfloat16", work)
    engine.close()
    expected = preset or f"0-{os.cpu_count() - 1}"
    assert log.read_text() == expected
    assert engine.extra["omp_threads_bind"] == expected


def test_phases_time_the_prompts_first_in_each_turn():
    throughput = load_throughput()
    calls = []

    def engine(name, seconds, prompts=None):
        def run(label, queue):
            calls.append(label)
            return queue.pop(0)

        return throughput.Started(
            name,
            partial(run, name, seconds),
            {},
            run_prompts=None if prompts is None else partial(run, f"{name}/p", prompts),
        )

    engines = [engine("a", [3.0, 4.0], prompts=[1.0, 1.5]), engine("b", [6.0, 8.0])]
    times = throughput.run_rounds(engines, 2, wait=lambda: calls.append("w"), phases=True)
    assert calls == ["w", "a/p", "w", "a", "w", "b", "w", "b", "w", "a/p", "w", "a"]
    assert times == {"a": [3.0, 4.0], "a prompts": [1.0, 1.5], "b": [6.0, 8.0]}
    assert throughput.phase_split(times, "a") == ([1.0, 1.5], [2.0, 2.5])
    assert throughput.phase_split(times, "b") is None
    # Without phases, run_prompts is never called.
    calls.clear()
    engines = [engine("a", [3.0], prompts=[1.0])]
    assert throughput.run_rounds(engines, 1, wait=lambda: None) == {"a": [3.0]}
    assert calls == ["a"]


def test_phase_report_medians_and_per_round_ratios():
    throughput = load_throughput()
    times = {
        "pagedllm": [3.0, 5.0, 4.0],
        "pagedllm prompts": [1.0, 2.0, 1.0],
        "hf batch 8": [30.0, 40.0, 36.0],
        "hf batch 8 prompts": [2.0, 2.0, 3.0],
        "vllm": [9.0, 9.0, 9.0],
    }
    results = {"pagedllm": {}, "hf": {"name": "hf batch 8"}, "vllm": {}}
    throughput.report_phases(times, results)
    # pagedllm: prompts 1, 2, 1 -> 1; the rest 2, 3, 3 -> 3. hf: prompts 2, 2, 3; rest 28, 38, 33.
    assert results["pagedllm"]["phases"] == {"prompts_s": 1.0, "rest_s": 3.0}
    assert results["hf"]["phases"] == {"prompts_s": 2.0, "rest_s": 33.0}
    assert "phases" not in results["vllm"]  # no prompt phase timed
    # Per round: prompts 2, 1, 3 -> 2x; the rest 14, 12.67, 11 -> 12.67x.
    assert results["pagedllm"]["vs_phases"] == {"hf": {"prompts": 2.0, "rest": 12.667}}


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
