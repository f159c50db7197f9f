#!/usr/bin/env bash
# Create .venv at the repository root and install pagedllm (editable) with its test extras, every
# package at the exact version constraints.txt records (the lock the suite was last run against;
# scripts/lock.sh refreshes it). torch is 2.13.0, which installs a local CPU wheel on our machines.
# Installs again whenever pyproject.toml or constraints.txt changes.
set -euo pipefail
cd "$(dirname "$0")/.."
lock=constraints.txt
stamp=.venv/.installed
want="$(cat pyproject.toml "$lock" | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
    || ! .venv/bin/python -c "import pagedllm, torch, pytest, hypothesis" 2>/dev/null; then
    # The build backend comes from the lock too (no build isolation), so nothing floats.
    .venv/bin/python -m pip install -q -c "$lock" pip setuptools
    .venv/bin/python -m pip install -q -c "$lock" --no-build-isolation -e '.[test]'
    echo "$want" > "$stamp"
fi
