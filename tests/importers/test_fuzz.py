"""Random JSON/YAML trees, in the shape of every format (their keys, wrong types, huge values): an import is a
result or one `InputError`, never another exception, and takes well under a second."""

import json
import time

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmem.errors import InputError
from llmem.importers import import_bytes

KEYS = ["zero_optimization", "stage", "offload_optimizer", "offload_param", "device", "bf16", "fp16", "enabled",
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "optimizer", "type",
        "distributed_type", "num_processes", "mixed_precision", "fsdp_config", "fsdp_version",
        "fsdp_reshard_after_forward", "fsdp_sharding_strategy", "fsdp_offload_params", "deepspeed_config",
        "zero_stage", "per_device_train_batch_size", "optim", "gradient_checkpointing", "max_length", "packing",
        "deepspeed", "fsdp", "peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save",
        "base_model_name_or_path", "base_model", "adapter", "load_in_4bit", "micro_batch_size", "sequence_len",
        "lora_target_linear", "model_name_or_path", "finetuning_type", "quantization_bit", "cutoff_len", "lora_target",
        "stage", "model", "_component_", "batch_size", "dtype", "lora_attn_modules", "tokenizer", "max_seq_len",
        "use_peft", "model_init_kwargs", "bnb_config_kwargs", "attention", "auto", "x"]
leaves = (st.none() | st.booleans() | st.sampled_from([0, -1, 1, 3, 8, 2**31, 10**30, 10**100, 1.5, 1e308])
          | st.floats(allow_nan=True) | st.sampled_from(["auto", "FSDP", "DEEPSPEED", "cpu", "LORA", "lora", "qlora",
                                                          "bf16", "full_shard", "adamw_torch", "all", "x" * 300])
          | st.text(max_size=8))
trees = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), inner, max_size=6),
                     max_leaves=24)
tops = st.dictionaries(st.sampled_from(KEYS), trees, min_size=1, max_size=10)
names = st.sampled_from(["ds_config.json", "accelerate.yaml", "args.json", "adapter_config.json", "axolotl.yml",
                         "recipe.yaml", "x.yaml"])


def _check(data: bytes, name: str, engine_torch: bool) -> None:
    start = time.perf_counter()
    try:
        result = import_bytes(data, name, engine_torch)
        result.lines()
        json.dumps(result.to_dict())
    except InputError as e:
        assert "\n" not in str(e)
    assert time.perf_counter() - start < 1.0


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(tops, names, st.booleans())
def test_random_json_trees(tree, name, engine_torch):
    _check(json.dumps(tree, allow_nan=True).encode(), name.replace(".yaml", ".json").replace(".yml", ".json"),
           engine_torch)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(tops, names, st.booleans())
def test_random_yaml_trees(tree, name, engine_torch):
    _check(yaml.safe_dump(tree).encode(), name.replace(".json", ".yaml"), engine_torch)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), names)
def test_random_bytes(data, name):
    _check(data, name, False)


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(tops, names, st.sampled_from([[], ["--engine", "torch"], ["--gpus", "4"]]))
def test_the_cli_over_random_files_is_a_result_or_one_line(tree, name, flags):
    """Whatever a file sets, `estimate --from` ends in a result (exit 0) or one stderr line (exit 2)."""
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    from llmem.cli import main

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(json.dumps(tree).encode() if name.endswith(".json") else yaml.safe_dump(tree).encode())
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["estimate", "--model", "gpt2", "--from", str(path), "--json", *flags])
    assert (code, err.getvalue()) == (0, "") or (code == 2 and len(err.getvalue().strip().splitlines()) == 1), \
        err.getvalue()
