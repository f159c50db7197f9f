#!/usr/bin/env bash
# Set up .venv (if missing), then serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000.
# Where the CPU has bf16 dot products (AVX-512-BF16 or AMX) the model runs in bfloat16, the
# fast configuration, unless the command line gives --dtype.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
dtype=()
case " $* " in
  *" --dtype "* | *" --dtype="*) ;;
  *) if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then dtype=(--dtype bfloat16); fi ;;
esac
exec .venv/bin/pagedllm serve "${dtype[@]}" "$@"
