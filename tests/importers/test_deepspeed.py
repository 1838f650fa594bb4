"""DeepSpeed JSON: batch and accumulation, bf16/fp16, the optimizer; ZeRO and offload only with --engine torch;
"auto" values filled from the Trainer's file or left at llmem's defaults, and said so."""

import pytest

from llmem.errors import InputError
from llmem.importers import import_bytes

from .conftest import ignored, load, settings, used


def test_numeric_zero2_config():
    r = load("ds_z2_numeric.json")
    assert settings(r) == {"batch_size": 4, "grad_accum": 2, "gpus": 8, "precision": "bf16-mixed",
                           "optimizer": "adamw"}
    assert "GPUs" in used(r, "train_batch_size")[0].why
    line = ignored(r, "zero_optimization.stage")
    assert "DeepSpeed engine is not modelled yet" in line.why and "--engine torch" in line.why
    assert "zero" not in r.options


def test_engine_torch_maps_stage_and_offload_to_the_nearest_pytorch_program():
    r = load("ds_z3_offload.json", engine_torch=True)
    assert settings(r) == {"zero": 3, "offload": "optimizer+params"}
    assert "nearest PyTorch program" in used(r, "zero_optimization.stage")[0].why


def test_auto_values_alone_keep_the_defaults_and_say_why():
    r = load("ds_z3_offload.json")
    assert r.options == {}
    why = {line.option: line.why for line in r.defaults}
    assert "'auto'" in why["batch_size"] and "per_device_train_batch_size" in why["batch_size"]
    assert "'auto'" in why["grad_accum"] and "'auto'" in why["precision"]
    assert ignored(r, "train_batch_size").value == "'auto'"


def test_auto_values_are_filled_from_the_trainer_file_in_either_order():
    for order in (("sft_config.yaml", "ds_z3_offload.json"), ("ds_z3_offload.json", "sft_config.yaml")):
        r = load(*order)
        auto = {line.option: line for line in r.used if line.file == "ds_z3_offload.json"}
        assert auto["batch_size"].setting == 2 and "sft_config.yaml: per_device_train_batch_size" in \
            auto["batch_size"].why
        assert auto["grad_accum"].setting == 8 and str(auto["precision"].setting) == "bf16-mixed"


@pytest.mark.parametrize("text, field", [
    ('{"zero_optimization": {"stage": 4}}', "ds.json: zero_optimization.stage"),
    ('{"train_micro_batch_size_per_gpu": 0}', "ds.json: train_micro_batch_size_per_gpu"),
    ('{"train_micro_batch_size_per_gpu": [1, 2]}', "ds.json: train_micro_batch_size_per_gpu"),
    ('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}', "ds.json: bf16.enabled"),
    ('{"bf16": {"enabled": "yes please"}}', "ds.json: bf16.enabled"),
])
def test_bad_values_name_the_file_and_key(text, field):
    with pytest.raises(InputError) as e:
        import_bytes(text.encode(), "ds.json")
    assert e.value.field == field


def test_precision_off_is_fp32_absent_is_the_launchers_and_optimizers_llmem_lacks_are_ignored():
    r = import_bytes(b'{"zero_optimization": {"stage": 0}, "optimizer": {"type": "Lamb"}}', "ds.json")
    assert "precision" not in r.options and "is (absent)" in next(x.why for x in r.defaults if x.option == "precision")
    assert "not modelled" in ignored(r, "optimizer.type").why
    r = import_bytes(b'{"bf16": {"enabled": false}, "fp16": {"enabled": false}}', "ds.json")
    assert str(r.options["precision"]) == "fp32"


def test_nvme_offload_is_ignored():
    r = import_bytes(b'{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}', "ds.json",
                     engine_torch=True)
    assert "offload" not in r.options and "NVMe" in r.ignored[0].why
