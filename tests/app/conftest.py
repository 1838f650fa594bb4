"""Shared helpers for the app tests: the app script's path and a way to capture what a download button serves."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "app.py")


@pytest.fixture
def served_files(monkeypatch):
    """Every file the app hands to Streamlit's media storage (download buttons) during the test, by mimetype."""
    from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage

    captured: list[tuple[str, bytes, str | None]] = []
    original = MemoryMediaFileStorage.load_and_get_id

    def record(self, path_or_data, mimetype, kind, filename=None):
        if isinstance(path_or_data, bytes):  # a str is a path Streamlit reads itself; the app never passes one
            captured.append((mimetype, path_or_data, filename))
        return original(self, path_or_data, mimetype, kind, filename)

    monkeypatch.setattr(MemoryMediaFileStorage, "load_and_get_id", record)
    return captured
