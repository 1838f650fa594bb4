"""DeepSpeed JSON: batch and accumulation, bf16/fp16, the optimizer; ZeRO-0/1/2/3 select --engine deepspeed with the
reduce bucket and overlap_comm (ZeRO-3: its prefetch bucket and persistence threshold), and map to the nearest
PyTorch program only with --engine torch; "auto" values filled from the
Trainer's file (or the model's hidden size) or left at llmem's defaults, and said so."""

import json

import pytest

from llmem.errors import InputError
from llmem.importers import import_bytes

from .conftest import ignored, load, settings, used


def test_numeric_zero2_config_selects_deepspeeds_own_program_with_its_buckets():
    r = load("ds_z2_numeric.json")
    assert settings(r) == {"batch_size": 4, "grad_accum": 2, "gpus": 8, "precision": "bf16-mixed",
                           "optimizer": "adamw", "zero": 2, "engine": "deepspeed", "ds_overlap_comm": True,
                           "ds_reduce_bucket": 500_000_000}
    assert "GPUs" in used(r, "train_batch_size")[0].why
    assert {line.option for line in used(r, "zero_optimization.stage")} == {"zero", "engine"}
    assert "all_gather_into_tensor_dp_groups" in ignored(r, "zero_optimization.allgather_bucket_size").why


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_modelled_stage_selects_the_engine_and_stage_0_reads_no_zero_field(stage):
    zero = {"stage": stage, "reduce_bucket_size": 2e6, "overlap_comm": True, "contiguous_gradients": False,
            "stage3_max_live_parameters": 1e9}
    r = import_bytes(json.dumps({"zero_optimization": zero}).encode(), "ds.json")
    assert settings(r)["engine"] == "deepspeed" and settings(r)["zero"] == stage
    assert "stage 3" not in ignored(r, "zero_optimization.stage3_max_live_parameters").why or stage == 3
    assert "not modelled" in ignored(r, "zero_optimization.contiguous_gradients").why or stage == 0
    if stage == 0:
        assert "ds_reduce_bucket" not in r.options and "ds_overlap_comm" not in r.options
        assert "MEMORY_OPT_ALLREDUCE_SIZE" in ignored(r, "zero_optimization.reduce_bucket_size").why
    else:
        assert r.options["ds_reduce_bucket"] == 2_000_000 and r.options["ds_overlap_comm"] is True


def test_engine_torch_keeps_the_nearest_pytorch_program_for_every_stage():
    r = import_bytes(b'{"zero_optimization": {"stage": 2, "overlap_comm": true}}', "ds.json", engine_torch=True)
    assert settings(r) == {"zero": 2} and "nearest PyTorch program" in used(r, "zero_optimization.stage")[0].why


def test_zero_offload_of_a_modelled_stage_is_set_for_the_plan_to_refuse_naming_the_key():
    r = import_bytes(b'{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}', "ds.json")
    assert settings(r)["offload"] == "optimizer" and "refused" in used(r, "zero_optimization.offload_optimizer."
                                                                          "device")[0].why


def test_auto_reduce_bucket_waits_for_the_model_then_is_its_hidden_size_squared():
    r = import_bytes(b'{"zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}}', "ds.json")
    assert "ds_reduce_bucket" not in r.options
    assert "hidden_size" in next(x.why for x in r.defaults if x.option == "ds_reduce_bucket")
    r.fill_from_model(4096)
    assert r.options["ds_reduce_bucket"] == 4096 ** 2 and "4096²" in used(r, "zero_optimization.reduce_bucket_size")[
        0].why
    assert all(x.option != "ds_reduce_bucket" for x in r.defaults)


def test_engine_torch_maps_stage_and_offload_to_the_nearest_pytorch_program():
    r = load("ds_z3_offload.json", engine_torch=True)
    assert settings(r) == {"zero": 3, "offload": "optimizer+params"}
    assert "nearest PyTorch program" in used(r, "zero_optimization.stage")[0].why


def test_auto_values_alone_keep_the_defaults_and_say_why():
    r = load("ds_z3_offload.json")
    assert r.options == {"zero": 3, "engine": "deepspeed", "offload": "optimizer+params", "ds_overlap_comm": False}
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


def test_zero3_selects_deepspeeds_own_program_with_its_sizes_filled_as_the_trainer_fills_them():
    """ZeRO-3 is DeepSpeed's own program now (docs/DEEPSPEED.md): "auto" prefetch bucket and persistence threshold
    wait for the model, then are transformers' int(0.9 h²) and 10 h (integrations/deepspeed.py:232-242); numbers
    are taken as they are; a reuse distance other than the modelled 1e9 is reported, not taken."""
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_reuse_distance": 1e8}
    r = import_bytes(json.dumps({"zero_optimization": zero}).encode(), "ds.json")
    assert settings(r) == {"zero": 3, "engine": "deepspeed"}
    assert "not modelled" in ignored(r, "zero_optimization.stage3_max_reuse_distance").why
    r.fill_from_model(1000)
    assert {k: r.options[k] for k in ("ds_reduce_bucket", "ds_prefetch_bucket", "ds_persistence_threshold")} == {
        "ds_reduce_bucket": 1_000_000, "ds_prefetch_bucket": 900_000, "ds_persistence_threshold": 10_000}
    assert "10 × 1000" in used(r, "zero_optimization.stage3_param_persistence_threshold")[0].why
    from llmem.plan import TrainingPlan

    TrainingPlan(**r.options, gpus=2)  # the plan takes them
    numeric = {"stage": 3, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5}
    r = import_bytes(json.dumps({"zero_optimization": numeric}).encode(), "ds.json")
    assert r.options["ds_prefetch_bucket"] == 50_000_000 and r.options["ds_persistence_threshold"] == 100_000
