"""On-disk cache of fitted tables: one JSON file per config, library versions, precision and attention.

The directory is `$LLMEM_CACHE_DIR`, else `$XDG_CACHE_HOME/llmem/derive`, else `~/.cache/llmem/derive`. A file that
cannot be read or written is ignored (the tables are traced again).
Shipped tables: `presets/<name>/derived/*.json`, written by `scripts/gen_derived_tables.py` for the presets'
default views, are read (never written) when the cache directory has no file of that name: the same key (the
library versions included, so other pinned versions trace afresh) and the same content as a fresh trace.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

FORMAT = 29
SHIPPED = Path(__file__).resolve().parents[2] / "presets"  # None: read no shipped table (the generator's traces)


def _directory() -> Path:
    if os.environ.get("LLMEM_CACHE_DIR"):
        return Path(os.environ["LLMEM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmem" / "derive"


@functools.cache
def _versions() -> tuple[str, ...]:
    """torch's and transformers' installed versions, read once per process (`metadata.version` parses the
    distribution's METADATA: ~40 ms a call, asked for every table looked up)."""
    versions = []
    for package in ("torch", "transformers"):
        try:
            versions.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            versions.append("")
    return tuple(versions)


NAMES = ("_name_or_path", "name_or_path")  # what a config is called, not what it builds: left out of the file name


def _path(config: dict, key: tuple) -> Path:
    """The file of `key` for `config`: named by a digest of the format, the library versions, the key and the config
    less its name (`NAMES`: the CLI names a preset's config, the app's source does not; one architecture, one file)."""
    named = {k: v for k, v in config.items() if k not in NAMES} if isinstance(config, dict) else config
    text = json.dumps([FORMAT, list(_versions()), list(key), named], sort_keys=True, default=str)
    return _directory() / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


@lru_cache(maxsize=4)
def _shipped_index(root: Path) -> dict[str, Path]:
    return {p.name: p for p in root.glob("*/derived/*.json")}


def _shipped_path(name: str) -> Path | None:
    """The shipped table of that file name, if any (the directories listed once)."""
    return None if SHIPPED is None else _shipped_index(SHIPPED).get(name)


def load(config: dict, key: tuple) -> dict | None:
    path = _path(config, key)
    for candidate in (path, _shipped_path(path.name)):
        try:
            return json.loads(candidate.read_text()) if candidate is not None else None
        except (OSError, ValueError):
            continue
    return None


def store(config: dict, key: tuple, fitted: dict | bool | str) -> dict | bool | str:
    path = _path(config, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(fitted))
        tmp.replace(path)
    except OSError:
        pass
    return json.loads(json.dumps(fitted))  # the same shape as a loaded file (lists, not tuples)
