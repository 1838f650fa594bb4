"""Precedence: a later file overrides an earlier one, a command-line option overrides every file; the report says
which line lost and to what."""

from .conftest import CONFIGS, ignored, load, settings


def test_a_later_file_overrides_an_earlier_one():
    r = load("training_args.json", "sft_config.yaml")
    assert settings(r)["batch_size"] == 2 and settings(r)["precision"] == "bf16-mixed"
    line = next(x for x in r.ignored if x.file == "training_args.json" and x.key == "per_device_train_batch_size")
    assert line.why == "overridden by sft_config.yaml: per_device_train_batch_size"
    r = load("sft_config.yaml", "training_args.json")
    assert settings(r)["batch_size"] == 4 and settings(r)["precision"] == "fp16-mixed"


def test_explicit_options_override_every_file_and_leave_the_defaults_list():
    r = load("sft_config.yaml", "ds_z3_offload.json", explicit={"batch_size": 1, "gpus": 8})
    assert "batch_size" not in r.options
    assert ignored(r, "per_device_train_batch_size").why == "overridden by --batch-size on the command line"
    assert "filled by --batch-size" in ignored(r, "train_micro_batch_size_per_gpu").why
    assert not {"batch_size", "gpus"} & {line.option for line in r.defaults}


def test_defaults_list_only_options_that_mean_something_in_the_plan():
    full = {line.option for line in load("training_args.json").defaults}
    assert "seq_len" in full and "lora_rank" not in full and "ckpt_every" not in full
    lora = {line.option for line in load("torchtune_8B_lora.yaml").defaults}
    assert "lora_modules_to_save" in lora and "seq_len" in lora and "lora_rank" not in lora


def test_files_are_listed_with_their_format():
    r = load("adapter_config.json", "accelerate_fsdp2.yaml", "llamafactory_qlora.yaml", "axolotl_qlora.yml",
             "torchtune_8B_lora.yaml", "ds_z2_numeric.json", "training_args.json")
    assert [fmt for _, fmt in r.files] == [
        "PEFT adapter_config.json", "accelerate config", "LLaMA-Factory config", "axolotl config",
        "torchtune recipe", "DeepSpeed config", "Hugging Face TrainingArguments / TRL SFTConfig"]


def test_a_launchers_mixed_precision_keeps_weights_a_file_loads_in_half():
    r = load("axolotl_qlora.yml", "accelerate_fsdp2.yaml")
    assert settings(r)["precision"] == "bf16"
    assert "the weights stay bf16 as axolotl_qlora.yml: bf16 loads them" in ignored(r, "mixed_precision").why
    assert settings(load("accelerate_fsdp2.yaml", "training_args.json"))["precision"] == "fp16-mixed"


def test_another_engines_key_says_when_the_command_line_sets_its_option(tmp_path):
    from llmem.importers import import_files

    fsdp1 = (CONFIGS / "accelerate_fsdp1.yaml").read_text().replace("fsdp_offload_params: false",
                                                                   "fsdp_offload_params: true")
    (tmp_path / "fsdp1.yaml").write_text(fsdp1)  # FSDP1's CPUOffload: the engine's own, not modelled
    r = import_files([str(tmp_path / "fsdp1.yaml")], False, {"offload": "optimizer+params"})
    assert ignored(r, "fsdp_config.fsdp_offload_params").why.endswith("; --offload on the command line sets it")
