"""Every preset: well-formed with provenance, counted exactly (closed form == meta-device model == published).

The meta-device counts build each real `transformers` model without memory (about 10 s for all presets on
two cores, 405B included), once per session.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from llmem import presets
from llmem.errors import InputError
from llmem.presets import PRESETS_DIR, list_presets, load_preset, search_presets
from llmem.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
NAMES = [info.name for info in list_presets()]
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "opt", "gpt_neox", "falcon",
             "bloom", "mixtral", "qwen2_moe"}


def test_enough_presets_across_supported_families():
    infos = list_presets()
    assert len(infos) >= 30
    assert {i.model_type for i in infos} <= SUPPORTED
    assert len({i.family for i in infos}) >= 12
    assert len(NAMES) == len(set(NAMES))


def test_every_directory_is_a_preset():
    dirs = sorted(d.name for d in PRESETS_DIR.iterdir() if d.is_dir())
    assert dirs == sorted(NAMES), "a presets/ directory lacks source.json"


@pytest.mark.parametrize("name", NAMES)
def test_preset_files_and_provenance(name):
    info = presets.get_preset(name)
    raw = info.config_path.read_bytes()
    assert len(raw) < 256 * 1024
    config = json.loads(raw)
    assert isinstance(config, dict)
    assert config["model_type"] == info.model_type
    assert name == name.lower() and " " not in name
    assert "/" in info.hf_id
    assert info.retrieved_from.startswith("https://")
    assert info.revision
    if info.published_params is not None:
        assert isinstance(info.published_params, int) and info.published_params > 0
        assert info.published_params_source and "http" in info.published_params_source
    if not info.verbatim:
        assert info.note, "a reconstructed config must say what it is based on"


@pytest.fixture(scope="session")
def meta_counts():
    """Parameter count of the real transformers model on the meta device, per preset (tied weights once)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    counts = {}
    for name in NAMES:
        config = transformers.AutoConfig.for_model(**load_preset(name))
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(config)
        counts[name] = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return counts


@pytest.mark.parametrize("name", NAMES)
def test_closed_form_equals_meta_device_count(name, meta_counts):
    spec = ModelSpec.from_config(load_preset(name))
    assert spec.total_params == meta_counts[name]
    assert spec.model_type == presets.get_preset(name).model_type


@pytest.mark.parametrize("name", [i.name for i in list_presets() if i.published_params is not None])
def test_published_count_matches(name, meta_counts):
    published = presets.get_preset(name).published_params
    assert ModelSpec.from_config(load_preset(name)).total_params == published
    assert meta_counts[name] == published


def test_import_reads_nothing_and_imports_no_torch():
    code = ("import sys, llmem.presets as p; assert p._index.cache_info().currsize == 0; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_listing_is_fast_and_cached():
    presets._index.cache_clear()
    start = time.perf_counter()
    first = list_presets()
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5
    assert list_presets() == first
    assert presets._index.cache_info().hits >= 1


def test_load_preset_returns_a_fresh_dict():
    a = load_preset("gpt2")
    a["n_layer"] = 1
    assert load_preset("gpt2")["n_layer"] == 12


def test_lookup_by_name_or_hf_id_is_case_insensitive():
    assert presets.find_preset("LLAMA-3.1-8B").name == "llama-3.1-8b"
    assert presets.find_preset("meta-llama/llama-3.1-8b").name == "llama-3.1-8b"
    assert presets.find_preset("no-such-model") is None


def test_unknown_name_suggests_close_presets():
    with pytest.raises(InputError) as err:
        load_preset("llama-3.1-8")
    assert err.value.field == "model"
    assert "did you mean" in str(err.value) and "llama-3.1-8b" in str(err.value)


def test_search_matches_every_word_in_name_id_or_family():
    assert "llama-3.1-8b" in [i.name for i in search_presets("llama 8b")]
    qwen25 = search_presets("Qwen2.5")
    assert qwen25 and all(i.family == "Qwen2.5" for i in qwen25)
    assert {i.name for i in search_presets("mistralai/")} >= {"mistral-7b-v0.3", "mixtral-8x7b"}
    assert search_presets("zzzz") == []
    assert len(search_presets("")) == len(NAMES)


def test_presets_table_is_current():
    spec = importlib.util.spec_from_file_location("gen_presets_table", ROOT / "scripts" / "gen_presets_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "PRESETS.md").read_text(encoding="utf-8") == module.render(), (
        "docs/PRESETS.md is stale: run python scripts/gen_presets_table.py")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme == module.render_readme(readme), "README.md's preset table is stale: run scripts/gen_presets_table.py"
