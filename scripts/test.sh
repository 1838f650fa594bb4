#!/usr/bin/env bash
# Set up .venv (with test tools) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements-dev.txt
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
