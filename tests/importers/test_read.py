"""Reading a file: JSON or PyYAML's safe loader, bounded size, never a pickle, one error line naming the file."""

import pytest

from llmem.errors import InputError
from llmem.importers import import_bytes
from llmem.importers.read import MAX_BYTES, parse


@pytest.mark.parametrize("data, name, words", [
    (b"\x80\x04\x95\x00", "training_args.bin", "never unpickles"),
    (b"{}", "training_args.bin", "to_json_string"),
    (b"PK\x03\x04rest", "args.json", "never unpickles"),
    (b"a: 1\n" * (MAX_BYTES // 4), "big.yaml", "limit 256 KiB"),
    (b"\xff\xfe", "x.yaml", "not UTF-8"),
    (b"[1, 2]", "x.json", "expected a mapping"),
    (b"{bad json", "x.json", "not valid JSON"),
    (b"a: [1", "x.yaml", "not valid YAML"),
    (b"a: !!python/object/apply:os.system [echo hi]", "x.yaml", "not valid YAML"),
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "x.json", "nests more than"),
    (b'{"a": ' + b"9" * 5000 + b"}", "x.json", "digits"),
    (b"a: 1\nb: 2\n", "x.yaml", "not a training config llmem reads"),
    (b'{"model_type": "llama", "hidden_size": 8}', "config.json", "a model's config.json goes to --model"),
    (b'{"train_batch_size": 8, "global_step": 10, "log_history": []}', "trainer_state.json", "not a training"),
])
def test_refused_in_one_line_naming_the_file(data, name, words):
    with pytest.raises(InputError) as e:
        import_bytes(data, name)
    assert e.value.field == f"--from {name}" and words in str(e.value) and "\n" not in str(e.value)


def test_yaml_and_json_give_the_same_tree():
    assert parse(b"a: 1\nb: [x, y]\n", "c.yaml") == parse(b'{"a": 1, "b": ["x", "y"]}', "c.json")


def test_yaml_aliases_are_not_expanded_into_the_report():
    laughs = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        b"%s: &%s [*%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s]\n" % ((bytes([c]),) * 2 + (bytes([c - 1]),) * 9)
        for c in range(ord("b"), ord("j")))
    r = import_bytes(laughs + b"micro_batch_size: 1\n", "axolotl.yaml")
    assert r.options["batch_size"] == 1
    assert all(len(line) < 2000 for line in r.lines())


def test_a_file_near_the_size_bound_is_read_or_refused_fast():
    import time

    many = b"micro_batch_size: 2\n" + b"".join(b"k%06d: [a, b, {c: 1}]\n" % i for i in range(10_000))
    fewer = b"micro_batch_size: 2\n" + b"".join(b"k%06d: [%s]\n" % (i, b"x" * 200) for i in range(1000))
    assert len(many) < MAX_BYTES and len(fewer) < MAX_BYTES
    start = time.perf_counter()
    with pytest.raises(InputError, match="more than 10,000 YAML values"):
        import_bytes(many, "axolotl.yaml")
    r = import_bytes(fewer, "axolotl.yaml")
    assert r.options["batch_size"] == 2 and "and 976 more" in r.lines()[-2]
    assert time.perf_counter() - start < 1.0


def test_paths_a_file_names_are_never_opened(monkeypatch, tmp_path):
    import builtins
    import io
    import pathlib

    opened = []
    real_open, real_path_open = builtins.open, pathlib.Path.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    monkeypatch.setattr(pathlib.Path, "open", lambda p, *a, **k: opened.append(str(p)) or real_path_open(p, *a, **k))
    names = b'{"per_device_train_batch_size": 1, "deepspeed": "private/ds.json", "fsdp": "full_shard",' \
            b' "fsdp_config": "private/fsdp.json", "model_name_or_path": "private/model"}'
    r = import_bytes(names, "args.json")
    assert r.options["batch_size"] == 1 and not [f for f in opened if "private/" in f]
    assert isinstance(io.BytesIO(), io.BytesIO)


def test_the_importers_need_no_torch():
    import subprocess
    import sys

    code = "import sys, llmem.importers, llmem.importers.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
