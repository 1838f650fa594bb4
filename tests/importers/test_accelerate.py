"""accelerate config YAML: processes, mixed precision, FSDP2 as llmem's own program, FSDP1 and DeepSpeed as other
engines."""

from llmem.importers import import_bytes

from .conftest import ignored, load, settings, used


def test_fsdp2_config():
    r = load("accelerate_fsdp2.yaml")
    assert settings(r) == {"gpus": 8, "precision": "bf16-mixed", "zero": 3, "grad_ckpt": "full"}
    assert "FSDP2" in used(r, "fsdp_config.fsdp_reshard_after_forward")[0].why


def test_fsdp2_without_resharding_is_zero2_and_offload_maps():
    text = b"distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\n" \
           b"  fsdp_reshard_after_forward: false\n  fsdp_offload_params: true\n"
    assert settings(import_bytes(text, "a.yaml")) == {"gpus": 4, "zero": 2, "offload": "optimizer+params"}


def test_fsdp1_is_engine_fsdp1_unless_engine_torch():
    """FULL_SHARD is llmem's FSDP1 program (--engine fsdp1 --zero 3); with --engine torch the nearest FSDP2 plan; a
    setting the FSDP1 program does not run (BACKWARD_POST) is reported, not applied."""
    r = load("accelerate_fsdp1.yaml")
    assert settings(r) == {"gpus": 2, "precision": "bf16-mixed", "zero": 3, "engine": "fsdp1"}
    assert "FSDP1" in used(r, "fsdp_config.fsdp_sharding_strategy")[0].why
    torch_engine = settings(load("accelerate_fsdp1.yaml", engine_torch=True))
    assert torch_engine["zero"] == 3 and "engine" not in torch_engine
    text = (b"distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
            b"  fsdp_backward_prefetch: BACKWARD_POST\n")
    r = import_bytes(text, "a.yaml")
    assert settings(r) == {"gpus": 4, "zero": 2, "engine": "fsdp1"}
    assert "BACKWARD_PRE" in ignored(r, "fsdp_config.fsdp_backward_prefetch").why
    no_shard = import_bytes(b"distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: "
                            b"NO_SHARD\n", "a.yaml")
    assert settings(no_shard) == {"gpus": 2, "zero": 0, "engine": "fsdp1"}
    from llmem.plan import TrainingPlan

    assert TrainingPlan(**r.options).strategy_label == "ZeRO-2 (FSDP1 SHARD_GRAD_OP)"


def test_deepspeed_plugin():
    r = load("accelerate_deepspeed.yaml")
    assert settings(r) == {"gpus": 8, "precision": "bf16-mixed", "grad_accum": 4, "zero": 3, "engine": "deepspeed",
                           "offload": "optimizer+params"}  # its offload set for the plan to refuse, naming the key
    assert "DeepSpeed ZeRO-3, its own program" in used(r, "deepspeed_config.zero_stage")[0].why
    r = load("accelerate_deepspeed.yaml", engine_torch=True)
    assert settings(r) == {"gpus": 8, "precision": "bf16-mixed", "grad_accum": 4, "zero": 3,
                                "offload": "optimizer+params"}


def test_multi_gpu_is_ddp_and_a_config_file_path_is_not_opened():
    r = import_bytes(b"distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp16\n", "a.yaml")
    assert settings(r) == {"gpus": 2, "zero": 0, "precision": "fp16-mixed"}
    r = import_bytes(b"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: private/ds.json\n",
                     "a.yaml")
    assert "never opens" in ignored(r, "deepspeed_config.deepspeed_config_file").why


def test_deepspeed_plugin_zero2_selects_deepspeeds_own_program():
    r = import_bytes(b"distributed_type: DEEPSPEED\nnum_processes: 4\nmixed_precision: bf16\ndeepspeed_config:\n"
                     b"  zero_stage: 2\n  offload_optimizer_device: none\n", "a.yaml")
    assert settings(r) == {"gpus": 4, "precision": "bf16-mixed", "zero": 2, "engine": "deepspeed"}
