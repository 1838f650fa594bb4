"""Model sources: preset, local config.json, Hugging Face hub (through transformers, tested on a local cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmem import sources
from llmem.errors import InputError
from llmem.presets import load_preset
from llmem.sources import MAX_CONFIG_BYTES, config_from_bytes, hub_error_message, resolve_model

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


def test_preset_name_and_preset_hf_id_need_no_network():
    by_name = resolve_model("llama-3.1-8b")
    assert by_name.config == load_preset("llama-3.1-8b")
    assert by_name.origin == "preset llama-3.1-8b (meta-llama/Llama-3.1-8B)"
    assert resolve_model("meta-llama/Llama-3.1-8B").origin == by_name.origin


def test_config_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    from_file = resolve_model(str(tmp_path / "config.json"))
    from_dir = resolve_model(str(tmp_path))
    assert from_file.config == from_dir.config == TINY
    assert from_file.origin == f"file {(tmp_path / 'config.json').resolve()}"


def test_directory_without_config(tmp_path):
    with pytest.raises(InputError, match="without a config.json"):
        resolve_model(str(tmp_path))


def test_missing_file_is_named():
    with pytest.raises(InputError, match="no such file"):
        resolve_model("./nowhere/config.json")


def test_unknown_name_is_an_input_error_with_suggestions():
    with pytest.raises(InputError) as err:
        resolve_model("qwen2.5-7")
    assert err.value.field == "model"
    assert "qwen2.5-7b" in str(err.value)
    with pytest.raises(InputError, match="empty"):
        resolve_model("  ")


def test_oversized_file_is_refused_before_reading(tmp_path):
    big = tmp_path / "config.json"
    big.write_text('{"model_type": "llama", "pad": "' + "x" * MAX_CONFIG_BYTES + '"}')
    with pytest.raises(InputError, match="KiB"):
        resolve_model(str(big))
    with pytest.raises(InputError, match="KiB"):
        config_from_bytes(big.read_bytes(), "upload.json")


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (b'{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}', r"not valid JSON at line 3 column"),
        (b"[1, 2, 3]", r"expected a JSON object \{\.\.\.\}, got list"),
        (b'"llama"', r"got str"),
        (b'{"hidden_size": 64}', r"no \"model_type\" key"),
        (b'{"model_type": ""}', r"no \"model_type\" key"),
        (b"\xff\xfe\x00garbage", r"not UTF-8"),
    ],
)
def test_bad_uploads_are_one_line_input_errors(data, pattern):
    with pytest.raises(InputError, match=pattern) as err:
        config_from_bytes(data, "config.json")
    assert err.value.field == "model"
    assert "\n" not in str(err.value)


def test_upload_with_byte_order_mark_is_accepted():
    assert config_from_bytes(b"\xef\xbb\xbf" + json.dumps(TINY).encode(), "c.json") == TINY


def test_malformed_file_reports_its_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",')
    with pytest.raises(InputError, match=r"config.json: not valid JSON at line 1"):
        resolve_model(str(path))


def _fake_cache(cache: Path, repo_id: str, config: dict, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face hub cache entry as huggingface_hub lays it out, so loading works offline."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


@pytest.fixture(scope="module")
def hub_results(tmp_path_factory):
    """Run the real hub path (transformers' AutoConfig) offline against a local cache, in one subprocess."""
    pytest.importorskip("transformers")
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    commit = _fake_cache(cache, "acme/tiny-llama", TINY)
    _fake_cache(cache, "acme/custom", {"model_type": "acme_custom", "architectures": ["AcmeForCausalLM"],
                                       "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}})
    script = (
        "import json, sys\n"
        "from llmem.sources import resolve_model\n"
        "from llmem.errors import InputError\n"
        "out = {}\n"
        "for model in sys.argv[1:]:\n"
        "    try:\n"
        "        src = resolve_model(model)\n"
        "        out[model] = {'origin': src.origin, 'config': src.config}\n"
        "    except InputError as e:\n"
        "        out[model] = {'error': str(e), 'field': e.field}\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_TOKEN", None)
    models = ["acme/tiny-llama", "acme/not-cached", "acme/custom", "acme/tiny-llama@" + commit]
    run = subprocess.run([sys.executable, "-c", script, *models], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    return commit, json.loads(run.stdout.strip().splitlines()[-1])


def test_hub_id_loads_through_transformers(hub_results):
    commit, results = hub_results
    loaded = results["acme/tiny-llama"]
    assert loaded["origin"] == f"Hugging Face hub: acme/tiny-llama @ {commit}"
    for key, value in TINY.items():
        assert loaded["config"][key] == value
    assert results["acme/tiny-llama@" + commit]["origin"] == loaded["origin"]


def test_hub_offline_and_not_cached(hub_results):
    error = hub_results[1]["acme/not-cached"]
    assert error["field"] == "model"
    assert "could not reach the Hugging Face hub" in error["error"]
    assert "use a preset or a local config.json" in error["error"]


def test_hub_remote_code_is_refused(hub_results):
    error = hub_results[1]["acme/custom"]["error"]
    assert "trust_remote_code" in error and "never enables" in error


def _hub_error(kind: str, status: int):
    """The hub exception transformers wraps in OSError (as `utils.hub.cached_files` does)."""
    import httpx2 as httpx  # the HTTP client huggingface_hub 2.x is built on
    from huggingface_hub import errors

    request = httpx.Request("GET", "https://huggingface.co/acme/x/resolve/main/config.json")
    response = httpx.Response(status, request=request)
    cause = getattr(errors, kind)(f"{status} Client Error", response=response)
    try:
        raise OSError("wrapped by transformers") from cause
    except OSError as wrapped:
        return wrapped


@pytest.mark.parametrize(
    ("kind", "status", "expected"),
    [
        ("GatedRepoError", 403, "gated or private; run `huggingface-cli login` or set HF_TOKEN"),
        ("RepositoryNotFoundError", 401, "gated or private"),
        ("RepositoryNotFoundError", 404, "was not found on the Hugging Face hub"),
        ("RevisionNotFoundError", 404, "that revision does not exist"),
    ],
)
def test_hub_errors_are_mapped_to_one_line_messages(kind, status, expected):
    pytest.importorskip("huggingface_hub")
    message = hub_error_message("acme/x", _hub_error(kind, status))
    assert expected in message
    assert "\n" not in message


def test_hub_failure_in_load_from_hub_is_an_input_error(monkeypatch):
    transformers = pytest.importorskip("transformers")

    def gated(*args, **kwargs):
        raise _hub_error("GatedRepoError", 403)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", gated)
    with pytest.raises(InputError, match="gated or private") as err:
        sources.resolve_model("meta-llama/Some-Gated-Model")
    assert err.value.field == "model"
