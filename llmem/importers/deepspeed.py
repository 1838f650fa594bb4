"""DeepSpeed config JSON (`ds_config.json`): micro-batch, accumulation, bf16/fp16, the optimizer, and the ZeRO stage
and offload, which select DeepSpeed's own program (not modelled yet: mapped to the nearest PyTorch one only with
--engine torch). `"auto"` values are the HF Trainer's to fill: from another file's TrainingArguments, or defaults."""

from __future__ import annotations

from llmem.errors import InputError
from llmem.importers.core import AUTO, NO_VALUE, Reader, short

NAME = "DeepSpeed config"
NO_EFFECT = frozenset("""
scheduler steps_per_print wall_clock_breakdown zero_allow_untested_optimizer comms_config monitor_config tensorboard
wandb csv_monitor flops_profiler prescale_gradients gradient_predivide_factor dump_state memory_breakdown
sparse_gradients communication_data_type gradient_clipping
""".split())
PROGRAM = {0: "DDP", 1: "ZeroRedundancyOptimizer", 2: "FSDP2 without reshard after forward",
           3: "FSDP2 with reshard after forward"}
ADAM = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")


def matches(tree: dict, name: str) -> bool:
    keys = ("zero_optimization", "train_micro_batch_size_per_gpu", "zero_allow_untested_optimizer")  # not
    # train_batch_size alone: the Trainer's trainer_state.json has one too
    return any(k in tree for k in keys) or isinstance(tree.get("bf16"), dict) or isinstance(tree.get("fp16"), dict)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read(r: Reader) -> None:
    _batch(r)
    _precision(r)
    _zero(r)
    _optimizer(r)
    if r.has("activation_checkpointing"):
        r.ignore("activation_checkpointing", "DeepSpeed's own checkpointing API (Megatron-style models); Hugging "
                 "Face models are checkpointed by the trainer's gradient_checkpointing")
    if r.has("amp"):
        r.ignore("amp", "apex AMP is not modelled")
    r.finish(NO_EFFECT)


def _batch(r: Reader) -> None:
    micro, accum = r.get("train_micro_batch_size_per_gpu"), r.get("gradient_accumulation_steps")
    for key, value, option, source in (
            ("train_micro_batch_size_per_gpu", micro, "batch_size", "per_device_train_batch_size"),
            ("gradient_accumulation_steps", accum, "grad_accum", "gradient_accumulation_steps")):
        if value == AUTO:
            r.auto(key, option, source)
        elif value is not None:
            r.set(key, option, value)
    total = r.get("train_batch_size")
    if total is None:
        return
    if total == AUTO:
        r.ignore("train_batch_size", "'auto': the Trainer computes it (GPUs × micro-batch × accumulation)")
    elif _int(total) and _int(micro) and _int(accum) and micro > 0 and accum > 0 and total % (micro * accum) == 0:
        r.set("train_batch_size", "gpus", total // (micro * accum),
              f"train_batch_size / (micro-batch {micro} × accumulation {accum}): the data-parallel GPUs")
    else:
        r.ignore("train_batch_size", "gives the GPU count only with a numeric micro-batch and accumulation that "
                 "divide it")


def _precision(r: Reader) -> None:
    b, f = r.flag("bf16.enabled"), r.flag("fp16.enabled")
    if b is True and f is True:
        raise InputError(f"{r.name}: bf16.enabled", "fp16 and bf16 are both enabled; DeepSpeed takes one")
    if b is True or f is True:
        half = "bf16" if b is True else "fp16"
        r.set(f"{half}.enabled", "precision", f"{half}-mixed", f"DeepSpeed's {half} keeps {half} weights and fp32 "
              "master weights and states in its optimizer; the nearest PyTorch program is autocast over fp32 weights")
    elif AUTO in (b, f):
        r.auto("bf16.enabled" if b == AUTO else "fp16.enabled", "precision", "bf16 / fp16")
    elif b is False and f is False:
        r.set("bf16.enabled", "precision", "fp32", "neither fp16 nor bf16 is enabled: DeepSpeed trains in fp32")
    elif r.has("zero_optimization"):  # an absent section is the launcher's to add (accelerate's mixed_precision)
        r.auto("bf16.enabled", "precision", "bf16 / fp16 (accelerate adds the section its mixed_precision names)",
               "(absent)")


def _zero(r: Reader) -> None:
    if not r.has("zero_optimization"):
        return
    z = r.section("zero_optimization")
    stage = z.get("stage", 0)
    if _int(stage) is None or stage not in PROGRAM:
        raise InputError(f"{r.name}: zero_optimization.stage", f"must be 0, 1, 2 or 3, got {short(stage)}")
    path = "zero_optimization.stage"
    r.engine(path, "zero", stage, "DeepSpeed", f"--zero {stage}, {PROGRAM[stage]}")
    offload(r, "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device", stage)
    rest = [k for k in z if k not in ("stage", "offload_optimizer", "offload_param")]
    if rest:
        r.ignore("zero_optimization." + ", ".join(str(k) for k in rest[:12]) + (" ..." if len(rest) > 12 else ""),
                 "DeepSpeed's own buffers and schedules (buckets, prefetch, persistence): not modelled yet", NO_VALUE)


def _optimizer(r: Reader) -> None:
    kind = r.text("optimizer.type")
    if kind is None:
        return
    if kind.strip().lower() in ADAM:
        r.set("optimizer.type", "optimizer", "adamw", "DeepSpeed's Adam/AdamW (FusedAdam, DeepSpeedCPUAdam): two "
              "fp32 states per parameter")
    else:
        r.ignore("optimizer.type", f"{kind[:40]} is not modelled; llmem has adamw, sgd, adafactor, adamw8bit and "
                 "paged-adamw8bit: pass --optimizer")


def offload(r: Reader, optimizer_key: str, param_key: str, stage: object) -> None:
    """DeepSpeed's offload devices (its JSON's `offload_optimizer/param.device`, accelerate's
    `offload_optimizer/param_device`) mapped to the nearest PyTorch program, or reported as not modelled."""
    opt = str(r.get(optimizer_key) or "none").strip().lower()
    par = str(r.get(param_key) or "none").strip().lower()
    if "nvme" in (opt, par):
        r.ignore(optimizer_key, "NVMe offload is not modelled", "nvme")
    elif opt == "cpu" and par == "cpu" and stage == 3:
        r.engine(param_key, "offload", "optimizer+params", "DeepSpeed",
                 "--offload optimizer+params, FSDP2's CPUOffloadPolicy")
    elif opt == "cpu":
        r.engine(optimizer_key, "offload", "optimizer", "DeepSpeed",
                 "--offload optimizer, torchao's CPUOffloadOptimizer on one GPU")
    elif par == "cpu":
        r.ignore(param_key, "parameter offload without optimizer offload has no PyTorch counterpart in llmem "
                 "(FSDP2's CPUOffloadPolicy moves both)")
