from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def load(*names: str, engine_torch: bool = False, explicit: dict | None = None):
    from llmem.importers import import_files

    return import_files([str(CONFIGS / n) for n in names], engine_torch, explicit)


def settings(result) -> dict:
    """The imported options as plain strings (enums by their value)."""
    return {k: v if isinstance(v, (bool, int, float)) else str(v) for k, v in result.options.items()}


def used(result, key: str) -> list:
    return [line for line in result.used if line.key == key]


def ignored(result, key: str):
    return next(line for line in result.ignored if line.key == key or key in line.key.split(", "))


@pytest.fixture
def configs() -> Path:
    return CONFIGS
