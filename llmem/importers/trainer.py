"""Hugging Face `TrainingArguments` and TRL `SFTConfig` as JSON or YAML (`trainer.args.to_json_string()`, an
`HfArgumentParser` YAML): per-device batch, accumulation, bf16/fp16, gradient checkpointing, the optimizer name,
max length and packing, and the FSDP / DeepSpeed settings the Trainer passes to accelerate."""

from __future__ import annotations

from llmem.importers import common, deepspeed
from llmem.importers.core import Reader
from llmem.importers.no_sync import hint

NAME = "Hugging Face TrainingArguments / TRL SFTConfig"
NO_EFFECT = frozenset("""
gradient_checkpointing_kwargs assistant_only_loss completion_only_loss dataset_kwargs eos_token pad_token
dataset_num_proc eval_packing packing_strategy logging_strategy save_on_each_node hub_token hub_private_repo
torch_empty_cache_steps average_tokens_across_devices accelerator_config ddp_find_unused_parameters
ddp_bucket_cap_mb ddp_broadcast_buffers prediction_loss_only eval_accumulation_steps eval_delay past_index
ignore_data_skip length_column_name dataset_name dataset_config dataset_train_split dataset_test_split
model_revision use_liger use_rslora lora_task_type dataloader_drop_last dataloader_persistent_workers
dataloader_prefetch_factor skip_memory_metrics use_cpu no_cuda jit_mode_eval full_determinism optim_target_modules
restore_callback_states_from_checkpoint
""".split())
ATTN = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "sdpa", "flash_attention_3": "sdpa"}
HALF = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32"}


def matches(tree: dict, name: str) -> bool:
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "optim", "output_dir", "max_seq_length",
            "packing", "gradient_checkpointing", "max_length")
    return any(k in tree for k in keys)


def read(r: Reader) -> None:
    r.copy((("per_device_train_batch_size", "batch_size"), ("gradient_accumulation_steps", "grad_accum")))
    _precision(r)
    ckpt = r.flag("gradient_checkpointing")
    if isinstance(ckpt, bool):
        r.set("gradient_checkpointing", "grad_ckpt", "full" if ckpt else "none",
              "every decoder layer, transformers' gradient_checkpointing_enable" if ckpt else "")
    common.optim(r, "optim", r.text("optim"))
    seq_len(r, ("max_length", "max_seq_length"), "packing")
    _model_kwargs(r)
    _trl_model(r)
    if r.flag("use_liger_kernel") is True:
        r.set("use_liger_kernel", "loss", "fused-linear-ce", "Liger's fused linear cross-entropy (its other kernels: "
              "RMSNorm, RoPE, SwiGLU are not modelled)")
    common.not_modelled(r, ("torch_compile", "auto_find_batch_size", "activation_offloading", "padding_free"))
    distributed(r)
    r.no_sync = hint(r)
    r.finish(NO_EFFECT)


def _precision(r: Reader) -> None:
    dtype = (r.get("model_init_kwargs.dtype") or r.get("model_init_kwargs.torch_dtype") or r.get("dtype")
             or r.get("torch_dtype"))
    pure = HALF.get(str(dtype).removeprefix("torch.")) in ("bf16", "fp16")
    how = ("the model is loaded in that dtype (dtype / model_init_kwargs), under the Trainer's autocast" if pure else
           "the Trainer's autocast over the weights as loaded (fp32 weights; load in bf16 for --precision bf16)")
    common.precision(r, "bf16", "fp16", pure, how)


def _model_kwargs(r: Reader) -> None:
    attn = r.get("model_init_kwargs.attn_implementation")
    if isinstance(attn, str) and attn in ATTN:
        r.set("model_init_kwargs.attn_implementation", "attn", ATTN[attn], "fused kernels keep no seq × seq matrices"
              if ATTN[attn] == "sdpa" else "")
    if r.get("model_init_kwargs.quantization_config") is not None:
        r.ignore("model_init_kwargs.quantization_config", "a quantized base is read from a PEFT/axolotl/LLaMA-Factory "
                 "file; here pass --method qlora --quant")


def _trl_model(r: Reader) -> None:
    """TRL's ModelConfig, which `trl sft --config` reads from the same YAML: the model, attention, PEFT."""
    common.model(r, "model_name_or_path")
    attn = r.get("attn_implementation")
    if isinstance(attn, str) and attn in ATTN:
        r.set("attn_implementation", "attn", ATTN[attn])
    if r.flag("use_peft") is not True:
        return
    four, eight = r.flag("load_in_4bit") is True, r.flag("load_in_8bit") is True
    r.set("use_peft", "method", "qlora" if four or eight else "lora", "LoRA over a bitsandbytes base" if four or
          eight else "PEFT LoRA adapters on a frozen base")
    if four:
        r.set("load_in_4bit", "quant", r.text("bnb_4bit_quant_type") or "nf4")
        r.set("use_bnb_nested_quant", "double_quant", r.flag("use_bnb_nested_quant") is True)
    elif eight:
        r.set("load_in_8bit", "quant", "int8")
    r.copy((("lora_r", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"),
            ("lora_modules_to_save", "lora_modules_to_save")))
    common.targets(r, "lora_target_modules", r.get("lora_target_modules"))


def seq_len(r: Reader, keys: tuple[str, ...], packing_key: str) -> None:
    """The first of `keys` set -> --seq-len: exact with packing, an upper bound without (batches padded to their
    longest sequence)."""
    packed = r.flag(packing_key)
    for key in keys:
        if r.has(key):
            note = ("packing: every sequence holds this many tokens" if packed is True else
                    "the longest a sequence may be: without packing, batches are padded to their longest sequence, "
                    "so this is an upper bound")
            r.set(key, "seq_len", r.get(key), note)
            return


def distributed(r: Reader, version_default: int = 2, enabled: bool = False) -> None:
    """`deepspeed` (an inline DeepSpeed config, or a path llmem does not open) and `fsdp` + `fsdp_config` (FSDP is on
    when `fsdp` is set, or when `enabled`), with the Trainer's legacy `fsdp` strings (shard_grad_op, offload)."""
    ds = r.get("deepspeed")
    if isinstance(ds, dict):
        deepspeed.read(r.nested("deepspeed", ds))
    elif ds:
        r.ignore("deepspeed", "a path; llmem never opens files a config names: pass that DeepSpeed JSON as another "
                 "--from")
    fsdp, cfg = r.get("fsdp"), r.get("fsdp_config")
    if not (fsdp or enabled):
        if cfg:
            r.ignore("fsdp_config", "read only when fsdp is set")
        return
    items = fsdp.split() if isinstance(fsdp, str) else [str(x) for x in fsdp] if isinstance(fsdp, list) else []
    version = common.fsdp(r, "fsdp_config", version_default, "fsdp_version" if r.has("fsdp_version") else "")
    has_reshard = any(str(k).removeprefix("fsdp_") in ("reshard_after_forward", "sharding_strategy")
                      for k in (cfg if isinstance(cfg, dict) else {}))
    legacy = [("shard_grad_op" in items and not has_reshard, "fsdp", "zero", 2, "shard_grad_op"),
              ("offload" in items, "fsdp", "offload", "optimizer+params", "offload"),
              (r.flag("fsdp_config.cpu_offload") is True, "fsdp_config.cpu_offload", "offload", "optimizer+params",
               "cpu_offload")]
    for on, key, option, value, what in legacy:
        if on and version == "2":
            r.set(key, option, value, f"{what}: FSDP2" + (" without reshard after forward" if option == "zero" else
                                                            " CPUOffloadPolicy"))
        elif on and version == "1" and option == "zero" and not r.engine_torch:  # --engine fsdp1 (common.fsdp)
            r.set(key, "zero", 2, "shard_grad_op: FSDP1 SHARD_GRAD_OP", shown=what)
        elif on and version == "1":
            r.engine(key, option, value, "FSDP1 (FullyShardedDataParallel)", f"--{option} {value}")
