import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# With PYTHONDONTWRITEBYTECODE set (as in this project's Dockerfile) every process of the run — each xdist
# worker, torchrun rank, CLI subprocess, and tests/test_api.py's import of each module into a fresh package —
# compiled the package's sources again. Write their bytecode once, as Python does itself without the variable
# (`__pycache__/`, git-ignored; an up-to-date file is left alone, a changed source recompiled on import).
if sys.dont_write_bytecode:
    import compileall

    _ROOT = Path(__file__).resolve().parents[1]
    compileall.compile_dir(_ROOT / "llmem", quiet=2)
    compileall.compile_file(_ROOT / "app.py", quiet=2)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# derived architectures' traced tables (`llmem.derive.cache`): one directory per test session, not the user's cache
if "LLMEM_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LLMEM_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmem-derive-")
    atexit.register(shutil.rmtree, os.environ["LLMEM_CACHE_DIR"], ignore_errors=True)
    if os.environ.get("LLMEM_TEST_SEEDS", "1") != "0":  # the suite's traced tables, if the package is unchanged
        from tests.seeds import seed

        seed(Path(os.environ["LLMEM_CACHE_DIR"]))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Repeatable property tests: the same examples on every run and machine (CI must not turn red by chance).
settings.register_profile("llmem", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("llmem")


def pytest_configure(config):
    """`LLMEM_HEAVY_RUN=1` unless the run keeps pyproject's default `-m 'not heavy'` (`-m heavy`, or the whole suite
    with `-m ''`): tests/components/multirank.py then measures every row, one row per harness otherwise. Set in the
    environment so xdist's workers see it too."""
    expr = (config.getoption("markexpr", "") or "").strip()
    os.environ["LLMEM_HEAVY_RUN"] = "0" if expr == "not heavy" else "1"


HEAVY_LIST = os.path.join(os.path.dirname(__file__), "heavy_list.txt")


def heavy_ids() -> set[str]:
    """The node ids of tests/heavy_list.txt: tests kept out of the default run for its time budget."""
    with open(HEAVY_LIST) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/heavy_list.txt names `heavy`, before `-m` selects (hence tryfirst)."""
    ids = heavy_ids()
    for item in items:
        if item.nodeid in ids:
            item.add_marker(pytest.mark.heavy)
