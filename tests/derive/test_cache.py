"""The derived tables and inventory are cached on disk: a second estimate of the same config, in a fresh process,
imports neither torch nor transformers and gives the same bytes."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.derive.configs import config

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import json, sys
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import modelled_spec
est = estimate(modelled_spec(json.load(open(sys.argv[1]))), TrainingPlan(batch_size=2, seq_len=48, attn="eager"))
print(json.dumps([est.peak_bytes, [m for m in ("torch", "transformers") if m in sys.modules]]))
"""


def test_a_repeated_estimate_reads_the_cache_without_torch(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config("granite")))
    env = {**os.environ, "LLMEM_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        out = subprocess.run([sys.executable, "-c", CODE, str(path)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    (first, heavy_first), (again, heavy_again) = run(), run()
    assert "torch" in heavy_first and heavy_again == [] and again == first > 0


def _gen():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_derived_tables", ROOT / "scripts" / "gen_derived_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_tables_are_named_by_their_keys_and_the_smallest_preset_s_traces_again_the_same():
    """`presets/<name>/derived/`: every file's name is still its key's (FORMAT and the pinned versions), and the
    smallest traced table of gemma-3-270m, traced again now, is the shipped file (`gen_derived_tables.py --check
    --one`; the whole workload of every preset: the heavy test below)."""
    gen = _gen()
    shipped = sorted(p.parent.parent.name for p in (ROOT / "presets").glob("*/derived/index.json"))
    assert "olmo-2-7b" in shipped and "qwen3-30b-a3b" in shipped
    assert gen.check_one("qwen3-30b-a3b") == []
    from llmem.derive import cache

    for name in shipped:  # the names alone: no trace
        index = json.loads((ROOT / "presets" / name / "derived" / "index.json").read_text())
        for file, entry in index["files"].items():
            assert cache._path(index["configs"][entry["config"]], gen.as_key(entry["key"])).name == file, name


@pytest.mark.parametrize("argv", [("compare", "--model", "qwen3-30b-a3b", "--gpus", "8"),
                                  ("compare", "--model", "deepseek-v2-lite"), ("estimate", "--model", "deepseek-v3"),
                                  ("compare", "--model", "deepseek-v3", "--gpus", "64"),
                                  ("compare", "--model", "gpt-oss-20b", "--gpus", "8")])
def test_a_default_view_of_a_derived_preset_on_a_fresh_server_traces_nothing(tmp_path, argv):
    """With an empty cache directory, a preset's default view reads the shipped tables: nothing is traced (nothing
    written to the cache) and the output is the one of a fresh trace (the heavy test compares them). The DeepSeek
    presets traced every layer before their dense first layers were a layer setting (`depth.layer_modules`):
    6 and 17 minutes cold on a loaded machine. DeepSeek's and gpt-oss's yarn `rope_scaling` was standardized in place by
    transformers, which changed the config (a cache key) after the first lookup: the inventory was counted again."""
    env = {**os.environ, "LLMEM_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "llmem", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.heavy
def test_every_shipped_preset_s_workload_traces_again_to_the_shipped_files_and_the_same_compare():
    """`gen_derived_tables.py --check` for each shipped preset (names, contents, no file missing or extra), and
    the compare of each preset read from the shipped tables byte-identical to a fresh trace's."""
    gen = _gen()
    shipped = sorted(p.parent.parent.name for p in (ROOT / "presets").glob("*/derived/index.json"))
    for name in shipped:
        assert gen.check(name) == [], name
    for name in shipped[:2]:
        outputs = []
        for fresh in ("1", ""):
            code = ("import sys, runpy; from llmem.derive import cache\n"
                    f"cache.SHIPPED = None if {fresh!r} else cache.SHIPPED\n"
                    "sys.argv = ['llmem', 'compare', '--model', sys.argv[1], '--gpus', '8']\n"
                    "runpy.run_module('llmem', run_name='__main__')")
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "LLMEM_CACHE_DIR": tmp}
                out = subprocess.run([sys.executable, "-c", code, name], cwd=ROOT, env=env, capture_output=True,
                                     text=True, timeout=3600)
            outputs.append((out.returncode, out.stdout))
        assert outputs[0] == outputs[1], name


def test_a_configs_name_does_not_name_its_file_and_each_spec_keeps_its_own_name(tmp_path, monkeypatch):
    """One architecture, one file (`cache.NAMES` left out of the name: the CLI names a preset's config, the app's
    source does not), and the spec read from it carries the asking config's name, not the one it was counted for."""
    from llmem.derive import cache
    from llmem.sources import resolve_model
    from llmem.spec import modelled_spec

    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path))
    config = resolve_model("deepseek-v2-lite").config
    named = {"_name_or_path": "my-finetune", **config}
    assert cache._path(config, ("inventory",)) == cache._path(named, ("inventory",))
    assert modelled_spec(named).name == "my-finetune" and modelled_spec(config).name == config["model_type"]
