"""`validate` and `measure` on bad input: one line naming the field, exit 2, before any worker starts."""

import time

import pytest
import torch

from llmem.cli import main

TINY = "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, " \
       "num_attention_heads: 4, vocab_size: 100}"
BOMB = "\n".join([
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
    *(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefg", "bcdefgh", strict=True)),
    "rows:",
    "  - {id: a, model: *h}",
])


def refused(capsys, field: str, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"error: {field}: " in lines[0], err
    return lines[0]


def suite(tmp_path, text: str, name: str = "s.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,field", [
    ("models: [1, 2]\nrows: [{id: a, model: t}]", "suite"),
    ("defaults: [1, 2]\nrows: [{id: a, model: gpt2}]", "suite"),
    ("rows: [{id: a, model: gpt2, steps: many}]", "steps"),
    ("rows: [{id: a, model: gpt2, steps: 0}]", "steps"),
    (f"models: {{t: {TINY}}}\nrows: [{{id: a, model: t, steps: 0}}]", "steps"),
    ("rows: [{id: a, model: /nonexistent/config.json}]", "model"),
    ("rows: [{id: a, model: [1, 2]}]", "suite"),
    ("models: {t: {model_type: llama, hidden_size: -1}}\nrows: [{id: a, model: t}]", "suite"),
    ("models: {t: {hidden_size: 64}}\nrows: [{id: a, model: t}]", "suite"),
    ("rows: " + "[" * 5000 + "]" * 5000, "suite"),
])
def test_bad_suites_are_one_line(tmp_path, capsys, text, field):
    refused(capsys, field, "validate", "--suite", suite(tmp_path, text), "--device", "cpu",
            "--out", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_binary_suite(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_bytes(bytes(range(128, 256)) * 20)
    assert "UTF-8" in refused(capsys, "suite", "validate", "--suite", str(path), "--device", "cpu")


def test_a_yaml_alias_bomb_is_refused_fast(tmp_path, capsys):
    t0 = time.perf_counter()
    assert "aliases" in refused(capsys, "suite", "validate", "--suite", suite(tmp_path, BOMB), "--device", "cpu")
    assert time.perf_counter() - t0 < 1.0


def test_out_pointing_at_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    path = suite(tmp_path, f"models: {{t: {TINY}}}\nrows: [{{id: a, model: t}}]")
    refused(capsys, "out", "validate", "--suite", path, "--device", "cpu", "--out", str(tmp_path / "afile"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_names_device(tmp_path, capsys):
    path = suite(tmp_path, f"models: {{t: {TINY}}}\nrows: [{{id: a, model: t}}]")
    refused(capsys, "device", "validate", "--suite", path, "--device", "cuda", "--out", str(tmp_path / "o"))
    refused(capsys, "device", "measure", "--model", "gpt2", "--device", "cuda")
    assert not (tmp_path / "o").exists()
