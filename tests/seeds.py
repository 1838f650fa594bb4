"""Traced tables for the default test run (`llmem.derive.cache` files), written by scripts/gen_test_seeds.py from a
whole default run and copied into the run's cache directory before any test starts, so each run does not trace the
suite's small architectures again (about half the accuracy cover's time).

They are used only when written by the package as it is now: the manifest names a digest of every source file of
`llmem/`, and any change there (a traced table can depend on the runtime, the spec or the derive code) leaves the
seeds unused, each table then traced afresh as without them. A cache file's name already carries the cache format
and the torch and transformers versions, so seeds of other pinned versions are never read either."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT / "tests" / "data" / "derived"
MANIFEST = "manifest.json"


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over every `llmem/**/*.py` (path and bytes, in path order)."""
    h = hashlib.sha256()
    for path in sorted((root / "llmem").rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def current(seeds: Path = SEEDS, root: Path = ROOT) -> bool:
    """Whether the seeds were written by the package as it is now."""
    try:
        manifest = json.loads((seeds / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("sources") == sources_digest(root)


def seed(cache_dir: Path, seeds: Path = SEEDS, root: Path = ROOT) -> int:
    """Copy the seeds into `cache_dir` when `current`; the number of tables copied."""
    if not current(seeds, root):
        return 0
    files = [p for p in seeds.glob("*.json") if p.name != MANIFEST]
    for p in files:
        shutil.copyfile(p, cache_dir / p.name)
    return len(files)


def write(cache_dir: Path, seeds: Path = SEEDS, root: Path = ROOT) -> int:
    """Replace the seeds by the tables in `cache_dir` (a finished run's), with the manifest of the sources now."""
    seeds.mkdir(parents=True, exist_ok=True)
    for p in seeds.glob("*.json"):
        p.unlink()
    files = sorted(p for p in cache_dir.glob("*.json") if len(p.stem) == 32)
    for p in files:
        shutil.copyfile(p, seeds / p.name)
    (seeds / MANIFEST).write_text(json.dumps({"sources": sources_digest(root), "tables": len(files)}, indent=1) + "\n")
    return len(files)
