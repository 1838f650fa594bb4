#!/usr/bin/env bash
# Create .venv in the repository root with the pinned dependencies (torch CPU wheel: torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r "${1:-requirements.txt}"
