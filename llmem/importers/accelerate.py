"""accelerate config YAML (`accelerate config` / `--config_file`): the process count, mixed precision, and the FSDP or
DeepSpeed plugin. FSDP2 (`fsdp_version: 2`) is llmem's torch program; FSDP1 sets --engine fsdp1
(with --engine torch: the nearest FSDP2 plan); DeepSpeed's ZeRO-0/1/2 set --engine deepspeed, its ZeRO-3 is mapped
to the nearest PyTorch program only with --engine torch."""

from __future__ import annotations

from llmem.errors import InputError
from llmem.importers import common, deepspeed
from llmem.importers.core import Reader, short

NAME = "accelerate config"
NO_EFFECT = frozenset("""
compute_environment machine_rank main_process_ip main_process_port main_training_function rdzv_backend same_network
tpu_env tpu_use_cluster tpu_use_sudo use_cpu debug enable_cpu_affinity gpu_ids downcast_bf16 num_machines
dynamo_config dynamo_backend ipex_config mpirun_config
""".split())
PRECISION = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}
SINGLE = ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")


def matches(tree: dict, name: str) -> bool:
    return "distributed_type" in tree or "compute_environment" in tree


def read(r: Reader) -> None:
    kind = (r.text("distributed_type") or "NO").strip().upper()
    if kind not in SINGLE:
        r.ignore("distributed_type", f"{kind} is not modelled (llmem: one GPU, DDP, FSDP2, and DeepSpeed or FSDP1 "
                 "as their nearest PyTorch programs)", kind)
    if r.has("num_processes"):
        r.set("num_processes", "gpus", r.get("num_processes"), "the processes of the whole job, one GPU each")
    if kind in ("MULTI_GPU", "NO") and r.has("distributed_type"):
        r.set("distributed_type", "zero", 0, "DistributedDataParallel" if kind == "MULTI_GPU" else "one process")
    _precision(r)
    if kind == "FSDP":
        common.fsdp(r, "fsdp_config", 1)
    elif r.has("fsdp_config"):
        r.ignore("fsdp_config", f"read only with distributed_type FSDP (this file: {kind})")
    if kind == "DEEPSPEED":
        _deepspeed(r)
    elif r.has("deepspeed_config"):
        r.ignore("deepspeed_config", f"read only with distributed_type DEEPSPEED (this file: {kind})")
    for key in ("megatron_lm_config", "fp8_config", "parallelism_config"):
        if r.has(key):
            r.ignore(key, "not modelled")
    r.finish(NO_EFFECT)


def _precision(r: Reader) -> None:
    mode = r.text("mixed_precision")
    if mode is None:
        return
    mode = mode.strip().lower()
    if mode in PRECISION:
        r.set("mixed_precision", "precision", PRECISION[mode], "autocast over fp32 weights" if mode != "no" else "")
    else:
        r.ignore("mixed_precision", f"{mode[:20]} is not modelled (llmem: no, bf16, fp16)")


def _deepspeed(r: Reader) -> None:
    """accelerate's own DeepSpeed keys; `deepspeed_config_file` names a file llmem does not open."""
    r.section("deepspeed_config")  # a mapping, or one line naming it
    if r.has("deepspeed_config.deepspeed_config_file"):
        r.ignore("deepspeed_config.deepspeed_config_file", "a path; llmem never opens files a config names: pass "
                 "that DeepSpeed JSON as another --from")
    stage = r.get("deepspeed_config.zero_stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise InputError(f"{r.name}: deepspeed_config.zero_stage", f"must be 0, 1, 2 or 3, got {short(stage)}")
        deepspeed.select_engine(r, "deepspeed_config.zero_stage", stage, f"--zero {stage}")
    deepspeed.offload(r, "deepspeed_config.offload_optimizer_device", "deepspeed_config.offload_param_device", stage)
    if r.has("deepspeed_config.gradient_accumulation_steps"):
        r.set("deepspeed_config.gradient_accumulation_steps", "grad_accum",
              r.get("deepspeed_config.gradient_accumulation_steps"))
