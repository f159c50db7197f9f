"""The prompt slice of a decoding step sized in time (engine/prefill_slice.py)."""

from __future__ import annotations

import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.prefill_slice import SMALLEST_CAP, PrefillSliceTuner
from pagedllm.engine.reports import cache_report
from pagedllm.sampling_params import SamplingParams


class FakeClock:
    """A clock that moves only when told: step times are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_no_cap_until_a_prompt_step_is_timed():
    tuner = PrefillSliceTuner(0.128, largest=512)
    assert tuner.cap() is None
    tuner.observe(0, 0.05)  # decode steps alone say nothing of a prompt token's cost
    tuner.observe(8, 0.30)  # too few prompt tokens to go by
    assert tuner.cap() is None


@pytest.mark.parametrize(
    ("token_ms", "expected"),
    [(0.5, 256), (2.0, 64), (2.2, 64), (1.4, 128), (0.05, 512), (40.0, SMALLEST_CAP)],
)
def test_cap_is_the_power_of_two_nearest_the_target(token_ms, expected):
    tuner = PrefillSliceTuner(0.128, largest=512)
    tuner.observe(0, 0.040)
    tuner.observe(100, 0.040 + 100 * token_ms / 1000)
    assert tuner.cap() == expected


def test_steps_are_timed_on_the_given_clock():
    clock = FakeClock()
    tuner = PrefillSliceTuner(0.128, largest=512, clock=clock)
    tuner.start_step()
    clock.advance(0.040)
    tuner.end_step(0)
    tuner.start_step()
    clock.advance(2 * (0.040 + 64 * 0.002))  # two forwards in one call
    tuner.end_step(64, num_steps=2)
    assert tuner.decode_s == pytest.approx(0.040, abs=1e-12)
    assert tuner.token_s == pytest.approx(0.002, abs=1e-12)
    assert tuner.cap() == 64


def test_the_decode_steps_time_is_not_counted_as_prompt_work():
    tuner = PrefillSliceTuner(0.128, largest=4096)
    for _ in range(20):
        tuner.observe(0, 0.100)  # a long decode step: weights streamed for 16 rows
    tuner.observe(64, 0.100 + 64 * 0.002)
    assert tuner.cap() == 64
    # Without the decode estimate the same step would read 3.6 ms a token.
    alone = PrefillSliceTuner(0.128, largest=4096)
    alone.observe(64, 0.100 + 64 * 0.002)
    assert alone.cap() == 32


def test_the_estimate_follows_a_changing_cost_smoothly():
    tuner = PrefillSliceTuner(0.128, largest=1024)
    tuner.observe(0, 0.01)
    tuner.observe(256, 0.01 + 256 * 0.0005)
    assert tuner.cap() == 256
    tuner.observe(256, 0.01 + 256 * 0.004)  # one slow step (a neighbour): moved, not jumped
    assert tuner.cap() == 128
    for _ in range(30):  # contexts grew: each prompt token costs 4 ms now
        tuner.observe(256, 0.01 + 256 * 0.004)
    assert tuner.cap() == 32


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        PrefillSliceTuner(0.0, largest=512)
    with pytest.raises(ValueError, match="largest"):
        PrefillSliceTuner(0.1, largest=SMALLEST_CAP - 1)
    for bad in (0, -5.0, True, "128"):
        with pytest.raises(ValueError, match="max_prefill_time_while_decoding_s"):
            EngineConfig(model="x", max_prefill_time_while_decoding_s=bad)


class _SlowPrompts:
    """Wraps a runner: each step moves ``clock`` on by 2 ms a prompt token (1-token entries
    decode, in no time); keeps each step's entry sizes."""

    def __init__(self, runner, clock: FakeClock):
        self._runner = runner
        self._clock = clock
        self.steps: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, output):
        sizes = sorted(len(s.token_ids) for s in output.scheduled)
        self.steps.append(sizes)
        self._clock.advance(sum(n for n in sizes if n > 1) * 0.002)
        return self._runner.execute(output)


def _timed_engine(fake_engine, token_cap: int):
    """An engine with a 64 ms prompt slice (and ``token_cap``) over 2 ms prompt tokens, timed
    on a fake clock."""
    engine = fake_engine(
        num_blocks=256,
        max_num_batched_tokens=256,
        max_prefill_tokens_while_decoding=token_cap,
        max_prefill_time_while_decoding_s=0.064,
    )
    clock = FakeClock()
    engine._slice_tuner.clock = clock
    engine.runner = _SlowPrompts(engine.runner, clock)
    return engine


def _run(engine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def test_the_engine_sets_the_schedulers_cap_from_its_steps(fake_engine, letter_ids):
    engine = _timed_engine(fake_engine, 256)
    assert engine.max_prefill_tokens_while_decoding == 256
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    _run(engine, "a", letter_ids[:1] * 100, params)
    # 64 ms of prompt work at 2 ms a token: 32 tokens; the stats and /v1/cache say so.
    assert engine.max_prefill_tokens_while_decoding == 32
    stats = engine.get_stats()
    assert stats.max_prefill_tokens_while_decoding == 32
    assert cache_report(stats)["max_prefill_tokens_while_decoding"] == 32
    engine.add_request("b", letter_ids[:1] * 8, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # b decodes from now on
    engine.add_request("c", letter_ids[1:2] * 90, params)
    before = len(engine.runner.steps)
    while engine.has_unfinished_requests():
        engine.step()
    # c's prompt came in 32-token slices beside b's decodes.
    assert engine.runner.steps[before : before + 2] == [[1, 32], [1, 32]]


def test_without_the_option_the_cap_stays_as_given(fake_engine, letter_ids):
    engine = fake_engine(num_blocks=128, max_prefill_tokens_while_decoding=48)
    engine.runner = _SlowPrompts(engine.runner, FakeClock())
    engine.add_request("a", letter_ids[:1] * 40, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.max_prefill_tokens_while_decoding == 48


def test_a_token_cap_given_with_the_time_is_the_most_the_engine_picks(fake_engine, letter_ids):
    """64 ms at 2 ms a token would be 32 tokens; with a 16-token cap given too, 16 (the
    server's defaults: 128 ms, at most 256 tokens)."""
    engine = _timed_engine(fake_engine, 16)
    _run(engine, "a", letter_ids[:1] * 100, SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine._slice_tuner.cap() == 16
    assert engine.max_prefill_tokens_while_decoding == 16
