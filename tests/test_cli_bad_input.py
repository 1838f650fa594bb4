"""Reproducers of bad input that once ended in a traceback: each now ends in one stderr line naming the field
and exit code 2 (or in a result). The CLI's `main` runs in-process here; `test_cli.py` covers the subprocess."""

import json

import pytest

from llmem.cli import main
from llmem.presets import list_presets


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, field: str, *argv: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmem: error: {field}: "), err
    return lines[0]


def write(tmp_path, text: str, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_json_nested_5000_deep_is_refused_without_recursion(tmp_path, capsys):
    path = write(tmp_path, '{"model_type": "llama", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    assert "nested" in refused(capsys, "model", "estimate", "--model", path)


def test_an_integer_of_5000_digits_is_refused(tmp_path, capsys):
    path = write(tmp_path, '{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    assert "digits" in refused(capsys, "model", "estimate", "--model", path)


@pytest.mark.parametrize("model_type, field", [("gptj", "model_type"), ("gpt_bigcode", "model_type"),
                                               ("llama4_text", "model_type"), ("deepseek_v3", "num_attention_heads")])
def test_a_causal_lm_outside_the_families_with_bad_sizes_names_the_field(tmp_path, capsys, model_type, field):
    """Outside the families a causal LM is derived from transformers (`llmem.derive`): a config transformers cannot
    build is one line naming model_type (or the bad key), never a traceback."""
    path = write(tmp_path, json.dumps({"model_type": model_type, "num_attention_heads": 0, "n_embd": -5}))
    refused(capsys, field, "estimate", "--model", path)


@pytest.mark.parametrize("name", [i.name for i in list_presets() if i.estimator == "not yet"])
@pytest.mark.parametrize("command", ["estimate", "compare", "plan-ckpt"])
def test_a_preset_not_modelled_yet_is_listed_but_refused_in_one_line(capsys, name, command):
    """A preset the derived path cannot take (DeepSeek-V3's dense first layers, expert layers not derived)
    is refused in one line naming the config key."""
    from llmem.derive.experts import LAYER_KIND_FIELDS
    from llmem.derive.tables import MOE_KEYS

    assert main([command, "--model", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmem: error: "), err
    field = err[0].removeprefix("llmem: error: ").split(":", 1)[0]
    assert field in MOE_KEYS + LAYER_KIND_FIELDS or "dropout" in field or "pdrop" in field, err


@pytest.mark.parametrize("model_type", ["bert", "t5", "bart", "roberta"])
def test_encoders_and_seq2seq_are_not_causal_lms(tmp_path, capsys, model_type):
    path = write(tmp_path, json.dumps({"model_type": model_type}))
    assert "not a causal language model" in refused(capsys, "model_type", "compare", "--model", path)


def test_an_unknown_model_type_is_named(tmp_path, capsys):
    path = write(tmp_path, json.dumps({"model_type": "no-such-arch"}))
    assert "not an architecture transformers knows" in refused(capsys, "model_type", "plan-ckpt", "--model", path)


@pytest.mark.parametrize("text", ["[1, 2]", "42", '"llama"', "null"])
def test_json_that_is_not_an_object(tmp_path, capsys, text):
    assert "JSON object" in refused(capsys, "model", "estimate", "--model", write(tmp_path, text))


def test_a_huge_file_is_refused_by_size(tmp_path, capsys):
    path = write(tmp_path, '{"model_type": "llama", "pad": "' + "x" * 300_000 + '"}')
    assert "limit" in refused(capsys, "model", "estimate", "--model", path)


def test_a_model_argument_longer_than_the_os_allows(capsys):
    refused(capsys, "model", "estimate", "--model", "a" * 5000)
    refused(capsys, "model", "estimate", "--model", "/" + "a" * 300)  # one path component over NAME_MAX


def test_wrong_types_name_the_key(tmp_path, capsys):
    path = write(tmp_path, json.dumps({"model_type": "llama", "hidden_size": "big"}))
    refused(capsys, "hidden_size", "estimate", "--model", path)


@pytest.mark.parametrize("verb", ["compare", "plan-ckpt", "estimate"])
def test_an_empty_gpu_type_is_an_error_not_a_silent_default(capsys, verb):
    refused(capsys, "gpu-type", verb, "--model", "gpt2", "--gpu-type", "")


def test_compare_csv_to_a_directory_or_a_missing_folder(tmp_path, capsys):
    assert "directory" in refused(capsys, "csv", "compare", "--model", "gpt2", "--csv", str(tmp_path))
    refused(capsys, "csv", "compare", "--model", "gpt2", "--csv", str(tmp_path / "missing" / "x.csv"))


def test_compare_csv_to_a_full_device(capsys):
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    assert "space" in refused(capsys, "csv", "compare", "--model", "gpt2", "--csv", "/dev/full").lower()


def test_compare_offload_params_method_on_one_gpu_and_on_four(capsys):
    code, out, err = run(capsys, "compare", "--model", "llama-3.1-8b", "--methods", "offload-params", "--json")
    assert code == 0, err
    code, out, err = run(capsys, "compare", "--model", "llama-3.1-8b", "--gpus", "4", "--methods",
                         "offload-params", "--json")
    assert code == 0, err
    labels = [r["strategy"] for r in json.loads(out)["rows"]]
    assert any("offload optimizer+params" in label and "ZeRO-3" in label for label in labels)


@pytest.mark.parametrize("seq_len", ["8388609", "16777216"])
def test_compare_accepts_every_sequence_estimate_accepts(capsys, seq_len):
    assert run(capsys, "estimate", "--model", "gpt2", "--seq-len", seq_len, "--json")[0] == 0
    code, out, err = run(capsys, "compare", "--model", "gpt2", "--seq-len", seq_len, "--gpu-type", "h100-sxm",
                         "--json")
    assert code == 0, err
    assert all(r["max_batch_size"] <= 1 for r in json.loads(out)["rows"])


TINY_EAGER_ONLY = {
    "gemma2": {"model_type": "gemma2", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
    "bloom": {"model_type": "bloom", "vocab_size": 128, "hidden_size": 32, "n_layer": 1, "n_head": 2},
}


@pytest.mark.parametrize("family", sorted(TINY_EAGER_ONLY))
def test_eager_only_models_run_eager_for_sdpa_in_estimate_and_measure_alike(family):
    """transformers 5.23 has no sdpa path for gemma2 and bloom (it raises when sdpa is forced): `--attn sdpa`
    is estimated as the eager program, and the runtime builds that same eager model."""
    from llmem import TrainingPlan
    from llmem.estimate import estimate
    from llmem.runtime.model import build_model
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(TINY_EAGER_ONLY[family])
    for device in ("cuda", "cpu"):
        plans = [TrainingPlan(seq_len=64, device=device, attn=a) for a in ("sdpa", "eager")]
        assert estimate(spec, plans[0]).peak_bytes == estimate(spec, plans[1]).peak_bytes
    model = build_model(TINY_EAGER_ONLY[family], TrainingPlan(seq_len=8, device="cpu", precision="fp32"))
    assert model.config._attn_implementation == "eager"


def test_opt_350m_mixed_precision_has_no_negative_category(capsys):
    for precision in ("bf16-mixed", "fp16-mixed"):
        code, out, err = run(capsys, "estimate", "--model", "opt-350m", "--precision", precision, "--json")
        assert code == 0, err
        data = json.loads(out)
        assert all(v >= 0 for v in data["breakdown"].values())
    from llmem import TrainingPlan
    from llmem.estimate import estimate
    from llmem.sources import resolve_model
    from llmem.spec import ModelSpec

    est = estimate(ModelSpec.from_config(resolve_model("opt-350m").config), TrainingPlan())
    assert all(b >= 0 for phase in est.phases for b in phase.breakdown.values())


def test_nothing_is_read_or_written_outside_the_inputs(tmp_path):
    """Good and bad inputs through every pure verb, run as a user would (a subprocess in an empty folder, HOME and the
    Hugging Face cache pointed into it): the folder holds afterwards exactly what it held before, and a decoy
    `config.json` beside the inputs (unparseable) is never picked up in place of the file or preset named."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "work"
    (work / "home").mkdir(parents=True)
    good = work / "good.json"
    good.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}))
    bad = work / "bad.json"
    bad.write_text("[" * 5000)
    (work / "config.json").write_text("{ decoy: not json")
    env = {**os.environ, "HOME": str(work / "home"), "HF_HOME": str(work / "home" / "hf"),
           "XDG_CACHE_HOME": str(work / "home" / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    for verb in ("estimate", "compare", "plan-ckpt"):
        for model, code in ((good, 0), (bad, 2), ("gpt2", 0)):
            proc = subprocess.run([sys.executable, "-m", "llmem", verb, "--model", str(model), "--json"], cwd=work,
                                  env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode in (code, 1 if verb == "plan-ckpt" else code), (verb, model, proc.stderr[-500:])
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before


def test_a_bound_above_one_is_named_not_called_positive(capsys):
    line = refused(capsys, "pp-stages-per-rank", "estimate", "--model", "llama-3.1-8b", "--gpus", "2", "--pp", "2",
                   "--pp-schedule", "interleaved-1f1b", "--microbatches", "4", "--pp-stages-per-rank", "1")
    assert "at least 2, got 1" in line and "positive" not in line


def test_a_closed_pipe_on_stdout_is_not_a_traceback():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "llmem", "estimate", "--model", "llama-3.1-8b", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(16)  # `| head -c 16`: the reader goes away after a few bytes
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 1) and "Traceback" not in err, err
