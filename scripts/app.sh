#!/usr/bin/env bash
# Set up .venv and start the web app on http://localhost:8501
# Listens on localhost only; set LLMEM_ADDRESS=0.0.0.0 to serve other machines (the Docker image does).
# Server settings (upload size, no file watching, no Deploy button) are in .streamlit/config.toml, read from here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements.txt
exec .venv/bin/python -m streamlit run app.py --server.headless true --server.port "${PORT:-8501}" \
    --server.address "${LLMEM_ADDRESS:-localhost}"
