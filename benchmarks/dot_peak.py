"""The CPU's peak multiply-add rate: what no kernel on this machine can beat.

    python benchmarks/dot_peak.py [--seconds S] [--rounds N]

Compiles (with the system C++ compiler) a loop of independent multiply-adds on registers
only, no memory traffic, and times it on one thread and on every core: bf16 dot products
(``vdpbf16ps``, the instruction small_gemm and the attention kernels use without AMX),
int8 and int16 dot products (``vpdpbusd`` / ``vpdpwssd``, quant_gemm's integer kernels on
AVX-512-VNNI) and float32 FMAs (AVX-512 and AVX2), each where this CPU has it. An int8
"flop" is half a multiply-add, as for the others. The tile unit (AMX) is not
measured here. Prints a table and one JSON line; figures are the medians of the rounds.

``benchmarks/throughput.py`` divides a workload's matrix work by the F.linear ceiling; this
is the ceiling of the instruction itself, for telling how far any engine could still go.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedllm.kernels.probe import cpu_info


def vnni_ymm_unit(intrinsic: str, fill: str, flops: int) -> dict:
    """A 256-bit AVX-512-VNNI integer dot product into 32-bit lanes, both inputs `fill`(1)."""
    return {
        "cflags": ["-mavx512f", "-mavx512vl", "-mavx512vnni"],
        "needs": {"avx512vl", "avx512_vnni"},
        "flops": flops,
        "setup": "__m256i acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_epi32(i);"
        f" __m256i a = {fill}(1), b = a;",
        "step": f"acc[i] = {intrinsic}(acc[i], a, b);",
        "sink": "_mm256_extract_epi32(acc[i], 0)",
    }


# Each unit: the compiler flags it needs, the CPU flags that must all be present, the
# accumulator type and the multiply-add (acc, a, b) on registers; flops per instruction.
UNITS = {
    "bf16 dot (vdpbf16ps zmm)": {
        "cflags": ["-mavx512f", "-mavx512bf16"],
        "needs": {"avx512f", "avx512_bf16"},
        "flops": 64,  # 16 lanes x 2 pairs x (multiply + add)
        "setup": "__m512 acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(i);"
        " __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;",
        "step": "acc[i] = _mm512_dpbf16_ps(acc[i], a, b);",
        "sink": "_mm512_reduce_add_ps(acc[i])",
    },
    "int8 dot (vpdpbusd zmm)": {
        "cflags": ["-mavx512f", "-mavx512vnni"],
        "needs": {"avx512f", "avx512_vnni"},
        "flops": 128,  # 16 lanes x 4 byte products x (multiply + add)
        "setup": "__m512i acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_epi32(i);"
        " __m512i a = _mm512_set1_epi8(1), b = a;",
        "step": "acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);",
        "sink": "_mm512_reduce_add_epi32(acc[i])",
    },
    # flops: 8 lanes x 4 byte products (vpdpbusd) or 2 int16 products (vpdpwssd) x 2
    "int8 dot (vpdpbusd ymm)": vnni_ymm_unit("_mm256_dpbusd_epi32", "_mm256_set1_epi8", 64),
    "int16 dot (vpdpwssd ymm)": vnni_ymm_unit("_mm256_dpwssd_epi32", "_mm256_set1_epi16", 32),
    "fp32 FMA (AVX-512 zmm)": {
        "cflags": ["-mavx512f", "-mfma"],
        "needs": {"avx512f"},
        "flops": 32,
        "setup": "__m512 acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(i);"
        " __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.0f);",
        "step": "acc[i] = _mm512_fmadd_ps(a, b, acc[i]);",
        "sink": "_mm512_reduce_add_ps(acc[i])",
    },
    "fp32 FMA (AVX2 ymm)": {
        "cflags": ["-mavx2", "-mfma"],
        "needs": {"avx2", "fma"},
        "flops": 16,
        "setup": "__m256 acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_ps(i);"
        " __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.0f);",
        "step": "acc[i] = _mm256_fmadd_ps(a, b, acc[i]);",
        "sink": "acc[i][0]",
    },
}

# Independent chains: enough to cover a multiply-add's latency on two pipes (4-6 cycles x 2).
# 24 measured slower on Zen 4 (vpdpbusd ymm at half its rate, AVX2 FMAs at 0.85x).
CHAINS = 12

PROGRAM = """
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
constexpr int N = CHAINS;
double run(long iters) {
  SETUP
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 64
    for (int i = 0; i < N; ++i) STEP
    asm volatile("" : "+x"(a));  // the inputs are not loop constants
  }
  double sink = 0;
  for (int i = 0; i < N; ++i) sink += SINK;
  return sink;
}
// argv: threads, iterations per thread; prints the seconds taken.
int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long iters = std::atol(argv[2]);
  std::vector<double> sinks(threads);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sinks[t] = run(iters); });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%.9f %g\\n", s, sinks[0]);
}
"""


def unit_rates(
    unit: dict, threads: list[int], seconds: float, rounds: int
) -> dict[int, list[float]]:
    """GFLOP/s of `unit` for each thread count, `rounds` timed runs each."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_unit(unit, Path(tmp))
        return {n: [gflops(exe, unit, n, seconds) for _ in range(rounds)] for n in threads}


def compile_unit(unit: dict, workdir: Path) -> Path:
    """The timing program for one unit, compiled; CalledProcessError if the compiler refuses."""
    source = PROGRAM.replace("CHAINS", str(CHAINS))
    for key in ("setup", "step", "sink"):
        source = source.replace(key.upper(), unit[key])
    src = workdir / "peak.cpp"
    exe = workdir / "peak"
    src.write_text(source)
    compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    subprocess.run(
        [compiler, "-O2", "-std=c++17", "-pthread", *unit["cflags"], str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    return exe


def gflops(exe: Path, unit: dict, threads: int, seconds: float) -> float:
    """GFLOP/s of `threads` threads, each running about `seconds` of the loop."""
    probe = 1_000_000
    taken = run_once(exe, 1, probe)
    iters = max(probe, int(probe * seconds / max(taken, 1e-6)))
    taken = run_once(exe, threads, iters)
    return threads * iters * CHAINS * unit["flops"] / taken / 1e9


def run_once(exe: Path, threads: int, iters: int) -> float:
    out = subprocess.run(
        [str(exe), str(threads), str(iters)], check=True, capture_output=True, text=True
    )
    return float(out.stdout.split()[0])


def measure(seconds: float, rounds: int) -> list[dict]:
    """Per unit this CPU has: the median GFLOP/s on one thread and on every core."""
    info = cpu_info()
    cores = os.cpu_count() or 1
    rows = []
    for name, unit in UNITS.items():
        missing = sorted(unit["needs"] - info.flags)
        if missing:
            rows.append({"unit": name, "skipped": f"this CPU lacks {', '.join(missing)}"})
            continue
        row: dict = {"unit": name}
        for threads, rates in unit_rates(unit, sorted({1, cores}), seconds, rounds).items():
            row[f"gflops_{threads}_threads"] = round(statistics.median(rates), 1)
            row[f"spread_{threads}_threads"] = [round(min(rates), 1), round(max(rates), 1)]
        rows.append(row)
    return rows


# The unit whose peak bounds a dtype's linears, where it is the fastest unit for them.
DTYPE_UNITS = {
    "bfloat16": ("bf16 dot (vdpbf16ps zmm)",),
    "float32": ("fp32 FMA (AVX-512 zmm)", "fp32 FMA (AVX2 ymm)"),
}


def instruction_peak(dtype: str, seconds: float = 0.2, rounds: int = 3) -> tuple[float | None, str]:
    """(FLOP/s on every core, the unit's name) for the fastest unit this CPU has for
    `dtype`'s matrix work, or (None, why not): bf16 on a CPU with the tile unit (AMX,
    faster than the dot products and not timed here) or without AVX-512-bf16."""
    info = cpu_info()
    if dtype == "bfloat16" and info.amx:
        return None, "the AMX tile unit is not timed by dot_peak.py"
    cores = os.cpu_count() or 1
    for name in DTYPE_UNITS.get(dtype, ()):
        unit = UNITS[name]
        if unit["needs"] <= info.flags:
            return max(unit_rates(unit, [cores], seconds, rounds)[cores]) * 1e9, name
    return None, f"this CPU has no unit dot_peak.py times for {dtype}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="per timed run (default 0.3)")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per figure (default 5)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("--seconds must be positive and --rounds at least 1")
    info = cpu_info()
    cores = os.cpu_count() or 1
    rows = measure(args.seconds, args.rounds)
    print(f"{info.label}, {cores} cores; medians of {args.rounds} rounds")
    print(f"{'unit':28} {'1 thread':>12} {f'{cores} threads':>12}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['unit']:28} skipped: {row['skipped']}")
            continue
        one, every = row["gflops_1_threads"], row[f"gflops_{cores}_threads"]
        print(f"{row['unit']:28} {one:>9.1f} GF {every:>9.1f} GF")
    print(json.dumps({"cpu": info.label, "cores": cores, "units": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
