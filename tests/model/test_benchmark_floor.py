"""benchmarks/throughput.py: the workload floor, computed by hand for a tiny config."""

import importlib.util
import json
import sys
from pathlib import Path

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
    assert floor.flops_per_row == 2 * (144 + 40)
    # Decode steps: the longest request's 3 tokens, the first from the prompt's step -> 2,
    # each running only the first request (the second has its one token from its prompt).
    assert floor.step_rows == (1, 1)
    assert floor.decode_weight_bytes == (144 + 40) * 2 * 2
    # K and V, 1 layer, 1 kv head of 2 dims, 2 bytes = 8 bytes a token; the first request's
    # 2nd and 3rd tokens read contexts of 4 and 5 tokens.
    assert floor.step_kv_bytes == (8 * 4, 8 * 5)
    assert floor.kv_bytes == 8 * (4 + 5)
    assert floor.prefill_flops == 2 * 144 * 4
    # Memory-bound: a step's 368 FLOPs take 0.32 at this ceiling, its bytes 50 and 51.
    decode_s, prompts_s = floor.seconds(bandwidth=8.0, ceiling=1152.0)
    assert (decode_s, prompts_s) == ((368 + 32 + 368 + 40) / 8.0, 1.0)
    assert floor.compute_bound_steps(bandwidth=8.0, ceiling=1152.0) == 0
    # Compute-bound: 368 FLOPs at 4 a second take 92, longer than either step's bytes.
    decode_s, prompts_s = floor.seconds(bandwidth=8.0, ceiling=4.0)
    assert (decode_s, prompts_s) == (2 * 92.0, 1152 / 4.0)
    assert floor.compute_bound_steps(bandwidth=8.0, ceiling=4.0) == 2


def test_workload_floor_mixes_bound_steps(tmp_path: Path):
    throughput = load_throughput()
    write_tiny_config(tmp_path)
    # Step 1 runs both requests (736 FLOPs, 368 + 8 * (4 + 3) bytes), step 2 the first only.
    work = throughput.Workload([[1, 2, 3], [4, 5]], [3, 2])
    floor = throughput.workload_floor(tmp_path, work, dtype_bytes=2)
    assert floor.step_rows == (2, 1)
    assert floor.step_kv_bytes == (8 * (4 + 3), 8 * 5)
    # At 8 FLOPs/s and 8 bytes/s: step 1 is its matrix work (92 > 53), step 2 its bytes (51 > 46).
    decode_s, _ = floor.seconds(bandwidth=8.0, ceiling=8.0)
    assert decode_s == 736 / 8.0 + (368 + 40) / 8.0
    assert floor.compute_bound_steps(bandwidth=8.0, ceiling=8.0) == 1


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
