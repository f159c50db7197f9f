#!/usr/bin/env bash
# Set up .venv (if missing) with the package and its test extras, then run the tests.
# With no arguments (what CI runs) and a CPU with AVX-512, the kernels' and models' tests run
# a second time on a build for an AVX2-only CPU (AMD Zen 3): the routes that CPU takes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -gt 0 ] || ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
echo "== the kernels and models again, built for AVX2 only (PAGEDLLM_MAX_ISA=avx2)"
# (Less the tokenizers' tests: no kernel runs in them, and the real GGUFs' take ~40 s.)
PAGEDLLM_MAX_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 exec .venv/bin/python -m pytest tests/kernels tests/model \
  --ignore=tests/model/test_hf_tokenizer_load.py
