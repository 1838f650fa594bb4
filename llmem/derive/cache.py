"""On-disk cache of fitted tables: one JSON file per config, library versions, precision and attention.

The directory is `$LLMEM_CACHE_DIR`, else `$XDG_CACHE_HOME/llmem/derive`, else `~/.cache/llmem/derive`. A file that
cannot be read or written is ignored (the tables are traced again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

FORMAT = 29


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


def _path(config: dict, key: tuple) -> Path:
    text = json.dumps([FORMAT, list(_versions()), list(key), config], sort_keys=True, default=str)
    return _directory() / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def load(config: dict, key: tuple) -> dict | None:
    try:
        return json.loads(_path(config, key).read_text())
    except (OSError, ValueError):
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
