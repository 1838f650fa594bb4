#!/usr/bin/env bash
# Set up .venv (with test tools) and run the default test suite: ruff, then pytest on two workers (pytest-xdist),
# printing the 60 slowest tests. Extra arguments go to pytest (e.g. `-n 0` for one process, `-k name`, `-m ''` for every test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements-dev.txt
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest -n "${LLMEM_TEST_WORKERS:-2}" --durations=60 "$@"
