"""The reader's checks: values shortened in the report whatever the file holds, out-of-range and wrong-typed values
refused in one line naming the file and key, unread keys listed once."""

import pytest

from llmem.errors import InputError
from llmem.importers import import_bytes
from llmem.importers.core import Reader, short


@pytest.mark.parametrize("value, text", [
    (None, "null"), (True, "true"), (10**40, "a number of about 41 digits"), ("x" * 100, repr("x" * 57 + "...")),
    (["q_proj", "v_proj"], "['q_proj', 'v_proj']"), (list(range(20)), "a list of 20 items"),
    ({"a": 1}, "a mapping of 1 keys"),
])
def test_short(value, text):
    assert short(value) == text


@pytest.mark.parametrize("text, field, words", [
    (b'{"train_micro_batch_size_per_gpu": 1e300}', "ds.json: train_micro_batch_size_per_gpu", "out of range"),
    (b'{"train_micro_batch_size_per_gpu": NaN}', "ds.json: train_micro_batch_size_per_gpu", "out of range"),
    (b'{"train_micro_batch_size_per_gpu": ["1", "2"]}', "ds.json: train_micro_batch_size_per_gpu", "one value"),
    (b'{"train_micro_batch_size_per_gpu": {"a": 1}}', "ds.json: train_micro_batch_size_per_gpu", "a mapping"),
    (b'{"gradient_accumulation_steps": "' + b"9" * 300 + b'", "train_batch_size": 1}',
     "ds.json: gradient_accumulation_steps", "300 characters"),
    (b'{"peft_type": "LORA", "r": 8, "lora_dropout": 1.5}', "adapter_config.json: lora_dropout", "[0, 1)"),
    (b'{"peft_type": "LORA", "r": 8, "target_modules": ["q proj"]}', "adapter_config.json: target_modules",
     "not a module name"),
])
def test_bad_values_are_one_line_naming_the_file_and_key(text, field, words):
    name = field.split(":")[0]
    with pytest.raises(InputError) as e:
        import_bytes(text, name)
    assert e.value.field == field and words in str(e.value) and len(str(e.value)) < 400


def test_unread_keys_are_listed_once_and_bounded():
    tree = {"micro_batch_size": 1, "learning_rate": 1e-4, "empty": None} | {f"k{i}": i for i in range(40)}
    r = Reader("a.yaml", tree)
    r.set("micro_batch_size", "batch_size", 1)
    r.finish()
    quiet, unknown = r.ignored
    assert quiet.key == "learning_rate" and quiet.why == "no effect on per-GPU memory"
    assert unknown.key.startswith("k0, k1") and unknown.key.endswith("and 16 more") and "empty" not in unknown.key
