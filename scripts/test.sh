#!/usr/bin/env bash
# Set up .venv (if missing) with the package and its test extras, then run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
