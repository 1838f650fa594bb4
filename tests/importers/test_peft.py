"""PEFT adapter_config.json."""

from llmem.importers import import_bytes

from .conftest import ignored, load, settings


def test_adapter_config():
    r = load("adapter_config.json")
    assert settings(r) == {"method": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                           "lora_targets": "q_proj,k_proj,v_proj,o_proj", "model": "llama-3.1-8b"}


def test_a_base_model_that_is_no_preset_is_reported_not_downloaded():
    r = import_bytes(b'{"peft_type": "LORA", "r": 8, "base_model_name_or_path": "/models/my-llama"}',
                     "adapter_config.json")
    assert "model" not in r.options
    assert "does not download or open" in ignored(r, "base_model_name_or_path").why


def test_regex_targets_dora_and_other_adapters():
    r = import_bytes(b'{"peft_type": "LORA", "r": 8, "target_modules": ".*\\\\.(q|v)_proj", "use_dora": true,'
                     b' "modules_to_save": ["lm_head"]}', "adapter_config.json")
    assert "lora_targets" not in r.options and "regular expression" in ignored(r, "target_modules").why
    assert r.options["lora_modules_to_save"] == "lm_head" and "DoRA" in ignored(r, "use_dora").why
    r = import_bytes(b'{"peft_type": "IA3", "r": 8}', "adapter_config.json")
    assert r.options == {} and "IA3" in ignored(r, "peft_type").why
