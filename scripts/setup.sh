#!/usr/bin/env bash
# Create .venv in the repository root with the pinned dependencies (torch CPU wheel: torch==2.13.0); with
# requirements-dev.txt also DeepSpeed (requirements-deepspeed.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r "${1:-requirements.txt}"
# With the dev requirements: DeepSpeed for the measured --engine deepspeed program, built against the torch above
# (requirements-deepspeed.txt says why it is a step of its own).
if [ "${1:-requirements.txt}" = requirements-dev.txt ]; then
    DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet --no-build-isolation -r requirements-deepspeed.txt
fi
