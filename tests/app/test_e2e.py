"""Real browser end to end: `streamlit run app.py` on a free port, headless Debian Chromium driven by Playwright.

Opens a share link, checks that the link's inputs reached the page (verdict, table, address bar), downloads the
CSV and parses it. Streamlit's browser code loads most element types (the table, number inputs, the download
button, Plotly) as separate scripts when they are first drawn, so the verdict can be on screen seconds before the
table on a busy machine: every wait after the first page load gets `UI_TIMEOUT`, not Playwright's 5 s default.
Needs /usr/bin/chromium (scripts/e2e_setup.sh installs it); skipped without it unless CI=true,
where a missing browser is a failure. LLMEM_UPDATE_SCREENSHOT=1 also writes the screenshot to docs/app.png.
"""

import io
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlencode

import pandas as pd
import pytest

from .conftest import APP, ROOT

CHROMIUM = "/usr/bin/chromium"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
LINK = {"model": "qwen2.5-7b", "gpu-type": "a100-80gb", "gpus": "8", "tp": "1", "zero": "all",
        "batch-size": "2", "seq-len": "2048", "precision": "bf16-mixed", "optimizer": "adamw",
        "optimizer-impl": "default", "grad-ckpt": "none", "attn": "sdpa"}

UI_TIMEOUT = 60_000  # ms; what a loaded 2-core CI runner needs to fetch and run the element scripts, with slack

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"streamlit did not answer on {url} within {timeout} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        if IN_CI:
            pytest.fail(f"{CHROMIUM} is missing in CI; run scripts/e2e_setup.sh first")
        pytest.skip(f"{CHROMIUM} not installed (run scripts/e2e_setup.sh); runs unconditionally when CI=true")
    for module in ("llmem.estimate", "llmem.compare", "llmem.units"):
        pytest.importorskip(module, reason=f"{module} has not landed yet; the app cannot render without it")
    port = _free_port()
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = {**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", APP, "--server.headless", "true", "--server.port", str(port),
             "--server.address", "127.0.0.1", "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(log.read_text()[-3000:])


def test_share_link_in_a_real_browser(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    link = f"{server}/?{urlencode(LINK)}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1900}, accept_downloads=True)
            page.set_default_timeout(UI_TIMEOUT)  # clicks and downloads; `expect` takes its timeout per call
            page.goto(link)
            verdict = page.get_by_text("Fits on 8× NVIDIA A100 80GB").or_(page.get_by_text("Short by")).first
            expect(verdict).to_be_visible(timeout=90_000)
            verdict_text = verdict.inner_text()
            assert "GiB" in verdict_text and "8× NVIDIA A100 80GB" in verdict_text
            assert page.get_by_text("Traceback").count() == 0
            assert page.locator("[data-testid='stException']").count() == 0

            table = page.locator("[data-testid='stTable'] table")
            expect(table).to_be_visible(timeout=UI_TIMEOUT)
            headers = [h.strip() for h in table.locator("thead th").all_inner_texts()]
            assert "per-GPU peak (GiB)" in headers and "max micro-batch" in headers
            shown_rows = table.locator("tbody tr").count()
            assert shown_rows >= 4
            assert "★" in table.inner_text() or "No strategy fits" in page.content()

            # the address bar is the share link: every input is still there after the app has run
            for key, value in LINK.items():
                assert f"{key}={value}" in page.url, (key, page.url)

            page.wait_for_timeout(1500)  # let the Plotly charts finish drawing before the screenshot
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("LLMEM_UPDATE_SCREENSHOT") == "1":
                shutil.copyfile(shot, ROOT / "docs" / "app.png")

            with page.expect_download(timeout=UI_TIMEOUT) as info:
                page.get_by_role("button", name="Download CSV").click()
            filename = info.value.suggested_filename
            text = open(info.value.path(), encoding="utf-8").read()
        finally:
            browser.close()

    assert filename.endswith(".csv")
    comments = [line for line in text.splitlines() if line.startswith("#")]
    for key, value in LINK.items():
        assert f"# {key}: {value}" in comments
    frame = pd.read_csv(io.StringIO(text), comment="#", keep_default_na=False)
    assert len(frame) == shown_rows
    assert {"strategy", "fits", "per-GPU peak (GiB)", "headroom (GiB)", "max micro-batch"} <= set(frame.columns)
    assert set(frame["fits"]) <= {"yes", "no"}
    assert (frame["recommended"] == "★").sum() <= 1
    assert pd.api.types.is_numeric_dtype(frame["per-GPU peak (GiB)"])
