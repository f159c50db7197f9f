#!/usr/bin/env bash
# Refresh constraints.txt to the newest releases that pyproject.toml's ranges allow, then run the
# whole suite against them: `bash scripts/lock.sh [pytest args]`. Commit the new lock on its own
# when the suite passes (an upgrade is a deliberate change); `git checkout constraints.txt` if not.
#
# The lock is `pip freeze` of a clean install: pip is the installer that takes our machines' local
# CPU torch wheel (uv and poetry resolve PyPI's CUDA build and its nvidia-* packages), and a freeze
# records exactly what that install put in the venv, the build backend and pip included.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip setuptools
"$work/venv/bin/python" -m pip install -q -e '.[test]'
{
    echo "# The exact versions the suite runs against; scripts/setup.sh installs with -c."
    echo "# Made by scripts/lock.sh on $(date -u +%Y-%m-%d), $("$work/venv/bin/python" -V), $(uname -m)."
    "$work/venv/bin/python" -m pip freeze --all --exclude-editable | LC_ALL=C sort -f
} > constraints.txt
git --no-pager diff --stat -- constraints.txt || true
exec bash scripts/test.sh "$@"
