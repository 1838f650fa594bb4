"""Every preset: well-formed with provenance, counted exactly (closed form == meta-device model == published).

The meta-device counts build each real `transformers` model without memory (some seconds for all presets on
two cores, 671B included), once per session. Presets of a `model_type` the estimator does not model yet are
listed and counted on the meta device; estimating one is the one-line "not modelled yet" refusal.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from llmem import presets
from llmem.errors import InputError
from llmem.families import FAMILIES
from llmem.presets import PRESETS_DIR, list_presets, load_preset, search_presets, supported_presets
from llmem.spec import ModelSpec, modelled_spec

ROOT = Path(__file__).resolve().parent.parent
NAMES = [info.name for info in list_presets()]
SUPPORTED_NAMES = [info.name for info in supported_presets()]
UNSUPPORTED_NAMES = [name for name in NAMES if name not in SUPPORTED_NAMES]
WAITING_NAMES = [info.name for info in list_presets() if info.estimator == "not yet"]
_ROUNDED = re.compile(r"^(\d+(?:\.(\d+))?)([MB])$")


def test_enough_presets_across_supported_families():
    infos = list_presets()
    supported = supported_presets()
    assert len(supported) >= 30
    assert len({i.family for i in supported}) >= 12
    assert len(NAMES) == len(set(NAMES))
    assert {i.model_type for i in supported} <= set(FAMILIES)
    assert len(infos) >= len(supported)


def test_supported_flag_is_the_estimators_family_table():
    for info in list_presets():
        assert info.supported == (info.model_type in FAMILIES), info.name
        assert info.estimator == ("yes" if info.supported else "derived" if info.derived else "not yet")
    derived = {i.model_type for i in list_presets() if i.derived}
    assert {"olmo2", "granite", "smollm3", "gemma3_text"} <= derived  # dense, dropout 0: traced from transformers


@pytest.mark.parametrize("name", [n for n in UNSUPPORTED_NAMES if n not in WAITING_NAMES])
def test_a_derived_preset_gets_a_derived_spec(name):
    spec = modelled_spec(load_preset(name))
    assert spec.derived is not None and spec.model_type == presets.get_preset(name).model_type


@pytest.mark.parametrize("name", WAITING_NAMES)
def test_a_preset_not_modelled_yet_is_refused_in_one_line(name):
    from llmem.derive.tables import static_refusal

    with pytest.raises(InputError) as err:
        modelled_spec(load_preset(name))
    expected = static_refusal(load_preset(name))
    assert expected is not None and ("experts" in err.value.field) == ("experts" in expected.field)
    assert "\n" not in str(err.value)


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
    if info.published_params_rounded is not None:
        assert _ROUNDED.match(info.published_params_rounded), info.published_params_rounded
        assert info.published_params_rounded_source and "http" in info.published_params_rounded_source
    if not info.verbatim:
        assert info.note, "a reconstructed config must say what it is based on"
    assert "auto_map" not in config, "presets are architectures transformers ships; no remote code"


@pytest.fixture(scope="session")
def meta_counts():
    """Parameter count of the real transformers model on the meta device, per preset (tied weights once)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    counts = {}
    for name in NAMES:
        assert load_preset(name)["model_type"] in transformers.CONFIG_MAPPING, f"{name}: unknown to transformers"
        config = transformers.AutoConfig.for_model(**load_preset(name))
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(config)
        counts[name] = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return counts


@pytest.mark.parametrize("name", SUPPORTED_NAMES)
def test_closed_form_equals_meta_device_count(name, meta_counts):
    spec = ModelSpec.from_config(load_preset(name))
    assert spec.total_params == meta_counts[name]
    assert spec.model_type == presets.get_preset(name).model_type


@pytest.mark.parametrize("name", [i.name for i in list_presets() if i.published_params is not None])
def test_published_count_matches(name, meta_counts):
    info = presets.get_preset(name)
    assert meta_counts[name] == info.published_params
    if info.supported:
        assert ModelSpec.from_config(load_preset(name)).total_params == info.published_params


def rounds_to(exact: int, stated: str) -> bool:
    """Whether `stated` ("0.6B", "21B", "124M") is `exact` rounded to the digits it shows."""
    match = _ROUNDED.match(stated)
    assert match, stated
    digits = len(match.group(2) or "")
    scale = 1e9 if match.group(3) == "B" else 1e6
    return round(exact / scale, digits) == float(match.group(1))


def test_rounding_check_can_fail():
    assert rounds_to(596_049_920, "0.6B") and rounds_to(20_914_757_184, "21B")
    assert not rounds_to(596_049_920, "0.5B") and not rounds_to(20_914_757_184, "20B")
    assert not rounds_to(1_720_574_976, "1.8B") and rounds_to(124_439_808, "124M")


@pytest.mark.parametrize("name", [i.name for i in list_presets() if i.published_params_rounded is not None])
def test_rounded_published_count_is_the_exact_count_rounded(name, meta_counts):
    assert rounds_to(meta_counts[name], presets.get_preset(name).published_params_rounded)


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


def test_the_simulation_sweep_takes_only_modelled_presets():
    from llmem.simulate.sweep import rows

    assert [name for name, _, _ in rows(max_params=1e13)] == SUPPORTED_NAMES
    assert [name for name, _, _ in rows(max_params=1e13, only=UNSUPPORTED_NAMES[:2] + ["gpt2"])] == ["gpt2"]
