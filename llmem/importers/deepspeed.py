"""DeepSpeed config JSON (`ds_config.json`): micro-batch, accumulation, bf16/fp16, the optimizer, and the ZeRO stage
and offload. ZeRO-0/1/2/3 select `--engine deepspeed` (DeepSpeed's own program) with its reduce bucket and
overlap_comm, and ZeRO-3's prefetch bucket and persistence threshold; mapped to the nearest PyTorch program only with
--engine torch. `"auto"` values are the HF Trainer's to fill: from another file's TrainingArguments, the model's
hidden size (transformers integrations/deepspeed.py:232-242), or defaults."""

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
              "master weights and states in its optimizer (--engine deepspeed); the nearest PyTorch program is "
              "autocast over fp32 weights")
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
    own = select_engine(r, path, stage, f"--zero {stage}, {PROGRAM[stage]}")
    offload(r, "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device", stage)
    rest = [k for k in z if k not in ("stage", "offload_optimizer", "offload_param")]
    if own:
        rest = _zero_fields(r, stage, rest)
    if rest:
        why = ("DeepSpeed's other ZeRO fields: not modelled yet" if own else
               "DeepSpeed's own buffers and schedules (buckets, prefetch, persistence): not modelled yet")
        r.ignore("zero_optimization." + ", ".join(str(k) for k in rest[:12]) + (" ..." if len(rest) > 12 else ""),
                 why, NO_VALUE)


def select_engine(r: Reader, path: str, stage: object, nearest: str) -> bool:
    """ZeRO-0/1/2/3 select `--engine deepspeed --zero N` (DeepSpeed's own program, modelled) unless the user asked
    for the nearest PyTorch program (--engine torch). Returns whether DeepSpeed's own program was selected."""
    if r.engine_torch:
        r.engine(path, "zero", stage, "DeepSpeed", nearest)
        return False
    r.set(path, "zero", stage, f"DeepSpeed ZeRO-{stage}, its own program")
    r.set(path, "engine", "deepspeed", "DeepSpeed 0.19's engine as the HF Trainer builds it")
    return True


MODELLED = {"contiguous_gradients": True, "reduce_scatter": True, "round_robin_gradients": False,
            "allgather_partitions": True}  # DeepSpeed's defaults (runtime/zero/config.py), the program llmem runs
NO_EFFECT_ZERO = {"allgather_bucket_size": "the step all-gathers whole partitions into the flat parameters "
                  "(runtime/utils.py all_gather_into_tensor_dp_groups); this bucket is not allocated on that path",
                  "sub_group_size": "ZeRO-3 and offload's optimizer sub-groups",
                  "stage3_gather_16bit_weights_on_model_save": "read when a checkpoint is saved, not in a step"}
# ZeRO-3's fields modelled at DeepSpeed's default (runtime/zero/config.py): one optimizer sub-group per rank below 1e9
# elements; every parameter kept gathered from its forward to its backward below 1e9 elements (docs/DEEPSPEED.md)
MODELLED_ZERO3 = {"stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9}
ZERO3_SIZES = {"stage3_prefetch_bucket_size": ("ds_prefetch_bucket", "model's 0.9 × hidden_size² (transformers "
                                               "integrations/deepspeed.py:236: stage3_prefetch_bucket_size 'auto')"),
               "stage3_param_persistence_threshold": (
                   "ds_persistence_threshold", "model's 10 × hidden_size (transformers integrations/deepspeed.py:240: "
                   "stage3_param_persistence_threshold 'auto')")}


def _zero_fields(r: Reader, stage: int, keys: list) -> list:
    """ZeRO's own fields: the reduce bucket ("auto" = hidden_size², as the Trainer fills it), overlap_comm, ZeRO-3's
    sizes (`_zero3_field`), the fields whose modelled value is DeepSpeed's default; returns the keys left for the
    not-modelled line."""
    rest = []
    for key in keys:
        path, value = f"zero_optimization.{key}", r.get(f"zero_optimization.{key}")
        if stage == 3 and _zero3_field(r, key, path, value):
            continue
        if stage == 0 and key in ("reduce_bucket_size", "overlap_comm", *MODELLED):
            r.ignore(path, "stage 0 builds no ZeRO optimizer: the engine all-reduces the gradients in buckets of "
                     "5e8 elements (engine.py MEMORY_OPT_ALLREDUCE_SIZE) whatever this says")
        elif key == "reduce_bucket_size" and value == AUTO:
            r.auto(path, "ds_reduce_bucket", HIDDEN_SQUARED)
        elif key == "reduce_bucket_size":
            number = int(value) if isinstance(value, float) and value.is_integer() else value
            r.set(path, "ds_reduce_bucket", number, "the contiguous gradient bucket, in elements")
        elif key == "overlap_comm":
            flag = r.flag(path)
            if flag is None or flag == AUTO:
                r.ignore(path, "DeepSpeed takes true or false (stages 1-2 default to false)")
            else:
                r.set(path, "ds_overlap_comm", flag, "two contiguous gradient buckets" if flag else "one bucket")
        elif key in MODELLED:
            if r.flag(path) not in (None, MODELLED[key]):
                r.ignore(path, f"llmem models DeepSpeed's default {key} = {str(MODELLED[key]).lower()}; other "
                         "values are not modelled")
        elif key in NO_EFFECT_ZERO or key.startswith("stage3_"):
            r.ignore(path, NO_EFFECT_ZERO.get(key, f"a ZeRO-3 field; stage {stage} reads none"))
        else:
            rest.append(key)
    return rest


def _zero3_field(r: Reader, key: str, path: str, value: object) -> bool:
    """A ZeRO-3 field: the prefetch bucket and persistence threshold (numbers, or "auto" filled from the model's
    hidden size), the fields modelled at DeepSpeed's default. Returns whether `key` was one."""
    if key in ZERO3_SIZES:
        option, why = ZERO3_SIZES[key]
        if value == AUTO:
            r.auto(path, option, why)
        else:
            number = int(value) if isinstance(value, float) and value.is_integer() else value
            r.set(path, option, number, "in elements")
    elif key in MODELLED_ZERO3:
        if value != MODELLED_ZERO3[key]:
            r.ignore(path, f"llmem models DeepSpeed's default {key} = 1e9; other values are not modelled")
    else:
        return False
    return True


HIDDEN_SQUARED = "model's hidden_size² (transformers integrations/deepspeed.py: reduce_bucket_size 'auto')"


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
    `offload_optimizer/param_device`) mapped to the nearest PyTorch program, or reported as not modelled; under
    DeepSpeed's own ZeRO-0/1/2 program an optimizer offload is set, for the plan to refuse naming the key."""
    opt = str(r.get(optimizer_key) or "none").strip().lower()
    par = str(r.get(param_key) or "none").strip().lower()
    if "nvme" in (opt, par):
        r.ignore(optimizer_key, "NVMe offload is not modelled", "nvme")
    elif opt == "cpu" and str(r.options.get("engine")) == "deepspeed":  # ZeRO-0/1/2/3 selected DeepSpeed's program
        both = par == "cpu" and stage == 3
        r.set(param_key if both else optimizer_key, "offload", "optimizer+params" if both else "optimizer",
              "DeepSpeed's ZeRO-Offload (DeepSpeedCPUAdam, pinned host buffers): not modelled, so the plan is "
              "refused naming this key")
    elif opt == "cpu" and par == "cpu" and stage == 3:
        r.engine(param_key, "offload", "optimizer+params", "DeepSpeed",
                 "--offload optimizer+params, FSDP2's CPUOffloadPolicy", "ZeRO-3")
    elif opt == "cpu":
        r.engine(optimizer_key, "offload", "optimizer", "DeepSpeed",
                 "--offload optimizer, torchao's CPUOffloadOptimizer on one GPU", "ZeRO-Offload")
    elif par == "cpu":
        r.ignore(param_key, "parameter offload without optimizer offload has no PyTorch counterpart in llmem "
                 "(FSDP2's CPUOffloadPolicy moves both)")
