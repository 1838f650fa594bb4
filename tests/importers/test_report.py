"""The report's lines and its JSON form."""

import json

from .conftest import load


def test_report_lines():
    lines = load("sft_config.yaml", "ds_z3_offload.json").lines()
    assert lines[:2] == ["read sft_config.yaml as Hugging Face TrainingArguments / TRL SFTConfig",
                         "read ds_z3_offload.json as DeepSpeed config"]
    assert "  used     sft_config.yaml: per_device_train_batch_size = 2  →  --batch-size 2" in lines
    assert any(x.startswith("  used     ds_z3_offload.json: train_micro_batch_size_per_gpu = 'auto'  →  "
                            "--batch-size 2  (filled from sft_config.yaml") for x in lines)
    assert any(x.startswith("  used     ds_z3_offload.json: zero_optimization.stage = 3  →  --zero 3") for x in lines)
    assert any(x.startswith("  ignored  sft_config.yaml: dataset_name, output_dir, learning_rate") and
               x.endswith("no effect on per-GPU memory") for x in lines)
    assert lines[-1].startswith("  default  --gpus 1, --tp 1, --pp 1") and lines[-1].endswith("(no file sets them)")


def test_to_dict_is_json():
    out = json.loads(json.dumps(load("axolotl_qlora.yml", "ds_z3_offload.json").to_dict()))
    assert out["options"]["method"] == "qlora" and out["files"][0]["format"] == "axolotl config"
    assert {"file", "key", "value", "option", "setting", "why"} == set(out["used"][0])


def test_link_query_is_what_the_app_decodes():
    from llmem.share import decode

    r = load("torchtune_8B_lora.yaml", "accelerate_fsdp2.yaml")
    inputs, warnings = decode(r.link_query())
    assert r.link_query()["grad-ckpt"] == "full" and r.link_query()["precision"] == "bf16"
    assert (inputs.method, inputs.lora_rank, inputs.gpus, inputs.zero, str(inputs.precision)) == \
        ("lora", 8, 8, 3, "bf16")
    assert warnings == []
