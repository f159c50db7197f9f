#!/usr/bin/env bash
# Create .venv at the repository root and install pagedllm (editable) with its test extras.
# torch is pinned to 2.13.0, which installs a local CPU wheel on our machines.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import pagedllm, torch, pytest, hypothesis" 2>/dev/null \
    || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    touch .venv/.installed
fi
