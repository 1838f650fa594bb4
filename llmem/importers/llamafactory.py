"""LLaMA-Factory YAML (`llamafactory-cli train x.yaml`): finetuning_type, LoRA settings, quantization_bit,
cutoff_len, the HF Trainer's arguments it passes on, and its own defaults where a key is absent (gradient
checkpointing on, double quantization on, lora_alpha = 2 × rank)."""

from __future__ import annotations

from llmem.importers import common, no_sync, trainer
from llmem.importers.core import Reader

NAME = "LLaMA-Factory config"
NO_EFFECT = frozenset("""
finetuning_args stage_args cache_dir model_revision hf_hub_token ms_hub_token om_hub_token print_param_status
export_dir export_size export_device export_quantization_bit export_legacy_format infer_backend tokenized_path
mix_strategy interleave_probs streaming buffer_size eval_dataset media_dir image_max_pixels video_max_pixels
freeze_vision_tower train_mm_proj_only use_fast_tokenizer split_special_tokens new_special_tokens resize_vocab
additional_target_modules loraplus_lr_ratio create_new_adapter adapter_name_or_path default_system enable_thinking
""".split())
TARGET_ALL = ("all", "all-linear")


def matches(tree: dict, name: str) -> bool:
    return any(k in tree for k in ("finetuning_type", "cutoff_len", "lora_target")) or (
        "model_name_or_path" in tree and any(k in tree for k in ("stage", "template")))


def read(r: Reader) -> None:
    common.model(r, "model_name_or_path")
    stage = (r.text("stage") or "sft").strip().lower()
    if stage not in ("sft", "pt"):
        r.ignore("stage", f"{stage[:10]} trains against a reference or reward model, not modelled; estimated as one "
                 "SFT step of the policy")
    _method(r)
    r.copy((("per_device_train_batch_size", "batch_size"), ("gradient_accumulation_steps", "grad_accum")))
    trainer.seq_len(r, ("cutoff_len",), "packing")
    common.optim(r, "optim", r.text("optim"))
    pure = r.flag("pure_bf16") is True
    if pure:
        r.set("pure_bf16", "precision", "bf16", "bf16 weights, gradients and optimizer states, no autocast")
    else:
        common.precision(r, "bf16", "fp16", r.text("finetuning_type") in ("lora", None),
                         "the base is loaded in this dtype (trainable fp32 adapters under autocast)"
                         if r.text("finetuning_type") in ("lora", None) else
                         "LLaMA-Factory upcasts the trained weights to fp32, under autocast")
    off = r.flag("disable_gradient_checkpointing")
    r.set("disable_gradient_checkpointing", "grad_ckpt", "none" if off is True else "full",
          "" if off is not None else "LLaMA-Factory checkpoints every layer unless this is true", shown=off)
    if r.flag("enable_liger_kernel") is True:
        r.set("enable_liger_kernel", "loss", "fused-linear-ce", "Liger's fused linear cross-entropy (its other "
              "kernels are not modelled)")
    flash = (r.text("flash_attn") or "auto").strip().lower()
    r.set("flash_attn", "attn", "eager" if flash == "disabled" else "sdpa", "" if r.has("flash_attn") else
          "auto: sdpa or FlashAttention, neither keeps seq × seq matrices", shown=flash)
    common.not_modelled(r, ("use_unsloth", "use_badam", "use_galore", "use_apollo", "use_dora", "pissa_init",
                            "use_adam_mini"))
    trainer.distributed(r)
    r.no_sync = no_sync.hint(r)  # it trains with the HF Trainer's loop
    r.finish(NO_EFFECT)


def _method(r: Reader) -> None:
    kind = (r.text("finetuning_type") or "lora").strip().lower()
    if kind not in ("lora", "full"):
        r.ignore("finetuning_type", f"{kind[:10]} fine-tuning is not modelled (llmem: full, lora)", kind)
        return
    bits = r.get("quantization_bit")
    if kind == "full":
        r.set("finetuning_type", "method", "full")
    elif bits is None:
        r.set("finetuning_type", "method", "lora", "" if r.has("finetuning_type") else "LLaMA-Factory's default")
    else:
        _quantized(r, bits)
    if kind == "full":
        return
    rank = r.get("lora_rank", 8)
    r.set("lora_rank", "lora_rank", rank, "" if r.has("lora_rank") else "LLaMA-Factory's default", shown=rank)
    alpha = r.get("lora_alpha")
    r.set("lora_alpha", "lora_alpha", alpha if alpha is not None else 2 * rank if isinstance(rank, int) else rank,
          "" if alpha is not None else "LLaMA-Factory's default: 2 × lora_rank", shown=alpha)
    if r.has("lora_dropout"):
        r.set("lora_dropout", "lora_dropout", r.get("lora_dropout"))
    else:
        r.set("lora_dropout", "lora_dropout", 0.0, "LLaMA-Factory's default", shown=None)
    target = r.get("lora_target", "all")
    if isinstance(target, str) and target.strip().lower() in TARGET_ALL:
        r.set("lora_target", "lora_targets", "all-linear", "" if r.has("lora_target") else "LLaMA-Factory's default",
              shown=target)
    else:
        common.targets(r, "lora_target", target)
    if r.has("additional_target"):
        r.set("additional_target", "lora_modules_to_save", r.get("additional_target"))


def _quantized(r: Reader, bits: object) -> None:
    method = (r.text("quantization_method") or "bnb").strip().lower()
    if method not in ("bnb", "bitsandbytes") or bits not in (4, 8):
        r.ignore("quantization_bit", f"{method[:12]} {bits if isinstance(bits, int) else '?'}-bit bases are not "
                 "modelled (llmem: bitsandbytes 4-bit and 8-bit); estimated as lora over an unquantized base")
        r.set("finetuning_type", "method", "lora")
        return
    r.set("quantization_bit", "method", "qlora", "LoRA over a bitsandbytes base")
    if bits == 8:
        r.set("quantization_bit", "quant", "int8")
        return
    quant = (r.text("quantization_type") or "nf4").strip().lower()
    r.set("quantization_bit", "quant", quant, "" if r.has("quantization_type") else "nf4, LLaMA-Factory's default")
    dq = r.flag("double_quantization")
    r.set("double_quantization", "double_quant", dq is not False,
          "" if dq is not None else "LLaMA-Factory's default: on", shown=dq)
