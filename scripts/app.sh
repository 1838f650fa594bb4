#!/usr/bin/env bash
# Set up .venv and start the web app on http://localhost:8501
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements.txt
exec .venv/bin/python -m streamlit run app.py --server.headless true --server.port "${PORT:-8501}"
