"""benchmarks/throughput.py: the workload floor, computed by hand for a tiny config."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_throughput():
    spec = importlib.util.spec_from_file_location("bench_throughput", BENCHMARKS / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_tiny_config(path: Path) -> None:
    config = {
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
    (path / "config.json").write_text(json.dumps(config))


def test_workload_floor_by_hand(tmp_path: Path):
    throughput = load_throughput()
    write_tiny_config(tmp_path)
    work = throughput.Workload([[1, 2, 3], [4]], [3, 1])
    floor = throughput.workload_floor(tmp_path, work, dtype_bytes=2)
    # A layer: qkv 4x(2+2)x2 + o 2x2x4 = 48, MLP 3x4x8 = 96 -> 144; head 4x10 = 40.
    assert floor.weight_bytes == (144 + 40) * 2
    # Attention: 2 heads of 2 dims, 1 layer: Q.K and the sum over V, 2 FLOPs a product ->
    # 16 FLOPs a key. Decode steps: the longest request's 3 tokens, the first from the
    # prompt's step -> 2, each running only the first request, whose tokens see 4 and 5 keys.
    assert floor.step_flops == (2 * 184 + 16 * 4, 2 * 184 + 16 * 5)
    assert floor.decode_weight_bytes == 184 * 2 * 2
    # K and V, 1 layer, 1 kv head of 2 dims, 2 bytes = 8 bytes a token.
    assert floor.step_kv_bytes == (8 * 4, 8 * 5)
    assert floor.kv_bytes == 8 * (4 + 5)
    # The prompts' 4 tokens through the layer; causal attention over 1 + 2 + 3 and 1 keys.
    assert floor.prefill_flops == 2 * 144 * 4 + 16 * (6 + 1)
    # Memory-bound: a step's 432 or 448 FLOPs take under 0.4 at this ceiling, its bytes 50, 51.
    decode_s, prompts_s = floor.seconds(bandwidth=8.0, ceiling=1264.0)
    assert (decode_s, prompts_s) == ((368 + 32 + 368 + 40) / 8.0, 1.0)
    assert floor.compute_bound_steps(bandwidth=8.0, ceiling=1264.0) == 0
    # Compute-bound: at 4 FLOPs a second the steps take 108 and 112, longer than their bytes.
    decode_s, prompts_s = floor.seconds(bandwidth=8.0, ceiling=4.0)
    assert (decode_s, prompts_s) == (108.0 + 112.0, 1264 / 4.0)
    assert floor.compute_bound_steps(bandwidth=8.0, ceiling=4.0) == 2
    # The roofline's matrix work: 8 tokens through the layer, the 4 outputs through the head,
    # the prompts' attention and the decoded tokens' (4 and 5 keys).
    assert throughput.workload_flops(tmp_path, work) == 2 * 144 * 8 + 2 * 40 * 4 + 16 * 7 + 16 * 9


def test_workload_floor_mixes_bound_steps(tmp_path: Path):
    throughput = load_throughput()
    write_tiny_config(tmp_path)
    # Step 1 runs both requests (their tokens see 4 and 3 keys), step 2 the first only (5).
    work = throughput.Workload([[1, 2, 3], [4, 5]], [3, 2])
    floor = throughput.workload_floor(tmp_path, work, dtype_bytes=2)
    assert floor.step_flops == (2 * 368 + 16 * 7, 368 + 16 * 5)
    assert floor.step_kv_bytes == (8 * 7, 8 * 5)
    # At 8 bytes/s and 10 FLOPs/s: step 1 is its matrix work (84.8 > 53), step 2 its bytes
    # (51 > 44.8).
    decode_s, _ = floor.seconds(bandwidth=8.0, ceiling=10.0)
    assert decode_s == pytest.approx(848 / 10.0 + 408 / 8.0)
    assert floor.compute_bound_steps(bandwidth=8.0, ceiling=10.0) == 1


def test_machine_rates_keep_the_highest_reading(monkeypatch):
    throughput = load_throughput()
    ceilings = iter([1.0, 3.0, 2.0, 0.5, 0.7, 0.6])
    bandwidths = iter([10.0, 5.0, 20.0])
    seen = []

    def ceiling(dtype, seconds):
        seen.append((dtype, seconds))
        return next(ceilings)

    monkeypatch.setattr(throughput, "matmul_ceiling", ceiling)
    monkeypatch.setattr(throughput, "read_bandwidth", lambda seconds: next(bandwidths))
    rates = throughput.MachineRates(("bfloat16", "float32"))
    rates.sample()
    rates.sample(0.25)
    rates.sample()
    # bf16 read 1.0, 2.0, 0.7; float32 3.0, 0.5, 0.6.
    assert rates.ceilings == {"bfloat16": 2.0, "float32": 3.0}
    assert rates.bandwidth == 20.0
    assert seen[2:4] == [(throughput.torch.bfloat16, 0.25), (throughput.torch.float32, 0.25)]
