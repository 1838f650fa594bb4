# Serves the llmem web app on port 8501:
#   docker build -t llmem . && docker run --rm -p 8501:8501 llmem   ->  http://localhost:8501
# Needs a Docker engine to build (see docs/APP.md); the pinned CPU torch wheel keeps the image GPU-free.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STREAMLIT_BROWSER_GATHER_USAGE_STATS=false \
    STREAMLIT_SERVER_HEADLESS=true

WORKDIR /app

# Dependencies first so that code changes do not reinstall them. torch comes from the CPU wheel index:
# the estimator never needs a GPU, and the CUDA wheels would add gigabytes.
COPY requirements.txt ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt

# Run from the source tree (not an installed wheel): the presets live next to the package, in presets/; the server
# settings (upload size, no file watching, no Deploy button) in .streamlit/config.toml, read from /app.
COPY app.py ./
COPY .streamlit ./.streamlit
COPY llmem ./llmem
COPY presets ./presets
ENV PYTHONPATH=/app
RUN useradd --create-home --uid 1000 llmem
USER llmem

EXPOSE 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://localhost:8501/_stcore/health', timeout=4)"
CMD ["python", "-m", "streamlit", "run", "app.py", "--server.address=0.0.0.0", "--server.port=8501"]
