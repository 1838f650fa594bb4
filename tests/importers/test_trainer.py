"""Hugging Face TrainingArguments / TRL SFTConfig, JSON or YAML."""

from llmem.importers import import_bytes

from .conftest import ignored, load, settings, used


def test_trl_sft_yaml():
    r = load("sft_config.yaml")
    assert settings(r) == {"batch_size": 2, "grad_accum": 8, "precision": "bf16-mixed", "grad_ckpt": "full",
                           "optimizer": "adamw", "optimizer_impl": "fused", "seq_len": 4096, "model": "qwen2.5-7b"}
    assert "packing" in used(r, "max_length")[0].why


def test_training_arguments_json():
    r = load("training_args.json")
    assert settings(r) == {"batch_size": 4, "grad_accum": 4, "precision": "fp16-mixed", "grad_ckpt": "none",
                           "optimizer": "adamw8bit", "optimizer_impl": "default"}


def test_optimizers_llmem_lacks_are_ignored_with_the_reason():
    r = import_bytes(b"per_device_train_batch_size: 1\noptim: paged_adamw_32bit\n", "args.yaml")
    assert "optimizer" not in r.options
    assert "paged 32-bit AdamW is not modelled" in ignored(r, "optim").why


def test_bf16_weights_loaded_in_bf16_are_pure_bf16():
    r = import_bytes(b"bf16: true\nper_device_train_batch_size: 1\nmodel_init_kwargs: {dtype: bfloat16}\n",
                     "sft.yaml")
    assert str(r.options["precision"]) == "bf16"


def test_inline_deepspeed_and_fsdp():
    r = import_bytes(b'{"per_device_train_batch_size": 2, "deepspeed": {"train_micro_batch_size_per_gpu": "auto",'
                     b' "zero_optimization": {"stage": 3}}}', "args.json", engine_torch=True)
    assert settings(r) == {"batch_size": 2, "zero": 3}
    auto = used(r, "deepspeed.train_micro_batch_size_per_gpu")[0]
    assert "filled from args.json: per_device_train_batch_size" in auto.why
    r = import_bytes(b"per_device_train_batch_size: 1\nfsdp: shard_grad_op auto_wrap offload\n", "args.yaml")
    assert settings(r) == {"batch_size": 1, "zero": 2, "offload": "optimizer+params"}
    r = import_bytes(b"per_device_train_batch_size: 1\ndeepspeed: ds_config.json\n", "args.yaml")
    assert "never opens" in ignored(r, "deepspeed").why


def test_trl_model_config_peft():
    text = (b"model_name_or_path: gpt2\nper_device_train_batch_size: 1\nuse_peft: true\nlora_r: 8\n"
            b"lora_target_modules: [c_attn]\nload_in_4bit: true\nuse_bnb_nested_quant: true\ndtype: bfloat16\n"
            b"bf16: true\n")
    assert settings(import_bytes(text, "sft.yaml")) == {
        "model": "gpt2", "batch_size": 1, "method": "qlora", "quant": "nf4", "double_quant": True, "lora_rank": 8,
        "lora_targets": "c_attn", "precision": "bf16"}
