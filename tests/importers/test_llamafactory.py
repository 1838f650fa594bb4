"""LLaMA-Factory YAML, with its own defaults where a key is absent."""

from .conftest import ignored, load, settings, used


def test_qlora_example():
    r = load("llamafactory_qlora.yaml")
    assert settings(r) == {
        "method": "qlora", "quant": "nf4", "double_quant": False, "lora_rank": 8, "lora_alpha": 16,
        "lora_dropout": 0.0, "lora_targets": "all-linear", "batch_size": 1, "grad_accum": 8, "seq_len": 2048,
        "precision": "bf16", "grad_ckpt": "full", "attn": "sdpa"}
    assert "2 × lora_rank" in used(r, "lora_alpha")[0].why
    assert "checkpoints every layer" in used(r, "disable_gradient_checkpointing")[0].why


def test_deepspeed_path_is_reported_not_opened():
    r = load("llamafactory_lora_ds3.yaml")
    assert settings(r)["method"] == "lora" and "deepspeed" not in r.options
    assert "never opens" in ignored(r, "deepspeed").why
