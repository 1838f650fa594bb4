"""Model presets: real Hugging Face `config.json` files shipped in `presets/<name>/`, each with its provenance.

A preset directory holds the model's `config.json` (unchanged where a verbatim copy was found) and a small
`source.json` saying where it came from and how many parameters its publisher states. Listing reads only the
`source.json` files, once, on first use; nothing is read at import time. Pure: no torch, no transformers.

A preset may be of a `model_type` the estimator does not model yet (`PresetInfo.supported` is False): it is still
listed, so its provenance and exact parameter count are at hand, and estimating it gives the one-line
"not modelled yet" refusal that any config of that architecture gets.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmem.errors import InputError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
_REQUIRED_SOURCE_KEYS = ("hf_id", "model_type", "family", "retrieved_from", "revision", "verbatim")


@dataclass(frozen=True)
class PresetInfo:
    """What `source.json` says about one preset (the config itself is read only by `load_preset`)."""

    name: str
    hf_id: str
    model_type: str
    family: str
    retrieved_from: str
    revision: str
    verbatim: bool
    published_params: int | None
    published_params_source: str | None
    note: str = ""
    published_params_rounded: str | None = None  # a stated rounded figure such as "0.6B" (checked as rounding)
    published_params_rounded_source: str | None = None

    @property
    def config_path(self) -> Path:
        return PRESETS_DIR / self.name / "config.json"

    @property
    def supported(self) -> bool:
        """Whether this preset's `model_type` is a hand-written family (`llmem.families`)."""
        from llmem.families import FAMILIES

        return self.model_type in FAMILIES

    @property
    def derived(self) -> bool:
        """Whether the estimator derives this preset from transformers instead (`llmem.derive`: traced on fake
        tensors on first use, then cached): a causal LM outside the families that the config alone does not rule
        out (no expert layers, dropout 0)."""
        if self.supported:
            return False
        from llmem.derive.tables import static_refusal
        from llmem.spec import is_causal_lm

        return is_causal_lm(self.model_type) and static_refusal(load_preset(self.name)) is None

    @property
    def estimator(self) -> str:
        """How the estimator handles the preset: "yes" (a hand-written family), "derived" or "not yet"."""
        return "yes" if self.supported else "derived" if self.derived else "not yet"


def _natural_key(text: str) -> list:
    """Sort key that orders "qwen2.5-7b" before "qwen2.5-14b" (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text.lower())]


def _read_info(directory: Path) -> PresetInfo:
    """Parse one `source.json`; a malformed one is a packaging bug, reported with its path."""
    path = directory / "source.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    missing = [key for key in _REQUIRED_SOURCE_KEYS if key not in data]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    return PresetInfo(
        name=directory.name,
        hf_id=data["hf_id"],
        model_type=data["model_type"],
        family=data["family"],
        retrieved_from=data["retrieved_from"],
        revision=str(data["revision"]),
        verbatim=bool(data["verbatim"]),
        published_params=data.get("published_params"),
        published_params_source=data.get("published_params_source"),
        note=data.get("note", ""),
        published_params_rounded=data.get("published_params_rounded"),
        published_params_rounded_source=data.get("published_params_rounded_source"),
    )


@lru_cache(maxsize=1)
def _index() -> tuple[PresetInfo, ...]:
    """Every preset, read once per process from the `source.json` files, in natural name order."""
    if not PRESETS_DIR.is_dir():
        return ()
    dirs = [d for d in PRESETS_DIR.iterdir() if (d / "source.json").is_file()]
    return tuple(_read_info(d) for d in sorted(dirs, key=lambda d: _natural_key(d.name)))


def list_presets() -> list[PresetInfo]:
    """All presets, sorted by name (numbers in names compare numerically)."""
    return list(_index())


def supported_presets() -> list[PresetInfo]:
    """The presets whose architecture the estimator models, in `list_presets` order."""
    return [info for info in _index() if info.supported]


def preset_names() -> list[str]:
    return [info.name for info in _index()]


def find_preset(name: str) -> PresetInfo | None:
    """The preset called `name`, or whose Hugging Face id is `name` (both case-insensitive); None if none."""
    key = name.strip().lower()
    for info in _index():
        if key in (info.name, info.hf_id.lower()):
            return info
    return None


def get_preset(name: str) -> PresetInfo:
    """Like `find_preset`, but an unknown name is an `InputError` that suggests the closest names."""
    info = find_preset(name)
    if info is None:
        raise InputError("model", _unknown_message(name))
    return info


def load_preset(name: str) -> dict:
    """The preset's `config.json` as a fresh dict (callers may modify it)."""
    info = get_preset(name)
    return json.loads(info.config_path.read_text(encoding="utf-8"))


def search_presets(text: str) -> list[PresetInfo]:
    """Presets whose name, id, family or model type contain every word of `text` (case-insensitive).

    "llama 8b", "Qwen2.5" and "mistralai/" all work; an empty text returns every preset.
    """
    words = re.split(r"[\s,]+", text.strip().lower())
    words = [w for w in words if w]
    return [info for info in _index() if all(w in _haystack(info) for w in words)]


def _haystack(info: PresetInfo) -> str:
    return " ".join((info.name, info.hf_id, info.family, info.model_type)).lower()


def _unknown_message(name: str) -> str:
    """One line naming the closest presets, so a typo costs one retry."""
    names = preset_names()
    close = difflib.get_close_matches(name.strip().lower(), names, n=3, cutoff=0.5)
    if not close:
        close = [info.name for info in search_presets(name)][:3]
    hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(names)} presets exist (see docs/PRESETS.md)"
    return f"{name!r} is not a preset, a config.json path or a Hugging Face id (org/name){hint}"
