#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent GPU machine: its own python3 with
# PyTorch + CUDA and transformers; pagedllm is used from the source tree, not installed).
# Writes its log and the benchmark's JSON line under ${OUT:-/tmp/gpu-check}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    "$python" -m pytest tests/engine/test_cuda_device.py -q -p no:cacheprovider -rs
    echo "tests rc=$?"
    "$python" benchmarks/throughput.py --device cuda --dtype bfloat16 --rounds 3 --hf-batch-sizes 8,32
    echo "benchmark rc=$?"
} 2>&1 | tee "$out/gpu_check.log"
