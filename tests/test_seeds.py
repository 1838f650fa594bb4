"""The traced tables copied into a test run's cache (tests/seeds.py): used only when the package's sources are
those that wrote them, and only files the cache itself would read."""

import json

from tests import seeds


def _package(tmp_path, text="x = 1\n"):
    (tmp_path / "llmem").mkdir(parents=True)
    (tmp_path / "llmem" / "a.py").write_text(text)
    return tmp_path


def test_seeds_of_these_sources_are_copied_and_of_others_are_not(tmp_path):
    root = _package(tmp_path / "repo")
    run = tmp_path / "run"
    run.mkdir()
    name = "0123456789abcdef0123456789abcdef.json"
    (run / name).write_text(json.dumps({"table": [1, 2]}))
    (run / "notacachefile.json").write_text("{}")
    store, cache = tmp_path / "seeds", tmp_path / "cache"
    cache.mkdir()
    assert seeds.write(run, store, root) == 1
    assert seeds.current(store, root) and seeds.seed(cache, store, root) == 1
    assert json.loads((cache / name).read_text()) == {"table": [1, 2]}
    (root / "llmem" / "a.py").write_text("x = 2\n")  # any change to the package: the seeds are stale
    assert not seeds.current(store, root) and seeds.seed(tmp_path / "nowhere", store, root) == 0


def test_the_committed_seeds_are_cache_files():
    """Every seed is a cache file name (32 hex digits) holding JSON, and the manifest counts them."""
    if not (seeds.SEEDS / seeds.MANIFEST).is_file():
        return
    files = [p for p in seeds.SEEDS.glob("*.json") if p.name != seeds.MANIFEST]
    assert json.loads((seeds.SEEDS / seeds.MANIFEST).read_text())["tables"] == len(files)
    for p in files:
        assert len(p.stem) == 32 and int(p.stem, 16) >= 0
        json.loads(p.read_text())
