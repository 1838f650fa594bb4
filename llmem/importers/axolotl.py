"""axolotl YAML: adapter (lora / qlora with load_in_4bit / load_in_8bit), LoRA settings, micro_batch_size,
sequence_len, accumulation, optimizer (the HF Trainer's names), bf16/fp16 (axolotl loads the weights in that dtype),
gradient checkpointing, attention, Liger's fused cross-entropy, FSDP; `deepspeed` names a file llmem does not open."""

from __future__ import annotations

from llmem.importers import common, no_sync, trainer
from llmem.importers.core import AUTO, Reader

NAME = "axolotl config"
NO_EFFECT = frozenset("""
base_model_config tokenizer_config lora_model_dir lora_fan_in_fan_out pad_to_sequence_len plugins liger_rope
liger_rms_norm liger_glu_activation liger_layer_norm hub_model_id save_first_step gradient_checkpointing_kwargs
unfrozen_parameters sequence_parallel_degree shuffle_merged_datasets dataset_processes is_llama_derived_model
""".split())
ATTENTION = {"flash_attention": "sdpa", "sdp_attention": "sdpa", "xformers_attention": "sdpa",
             "flex_attention": "sdpa", "eager_attention": "eager"}
ATTENTION_NAMES = {"flash": "sdpa", "sdpa": "sdpa", "xformers": "sdpa", "flex": "sdpa", "eager": "eager"}


def matches(tree: dict, name: str) -> bool:
    return "base_model" in tree or any(k in tree for k in ("micro_batch_size", "sequence_len", "lora_target_linear"))


def read(r: Reader) -> None:
    common.model(r, "base_model")
    _method(r)
    r.copy((("micro_batch_size", "batch_size"), ("gradient_accumulation_steps", "grad_accum")))
    trainer.seq_len(r, ("sequence_len",), "sample_packing")
    common.optim(r, "optimizer", r.text("optimizer"))
    _precision(r)
    ckpt = r.get("gradient_checkpointing")
    if ckpt is True or ckpt is False:
        r.set("gradient_checkpointing", "grad_ckpt", "full" if ckpt else "none")
    elif isinstance(ckpt, str) and ckpt.strip().lower() == "offload":
        r.set("gradient_checkpointing", "grad_ckpt", "full", "offload moves the checkpointed inputs to host memory: "
              "llmem keeps them on the GPU (an upper bound)")
    _attention(r)
    if r.flag("liger_fused_linear_cross_entropy") is True:
        r.set("liger_fused_linear_cross_entropy", "loss", "fused-linear-ce")
    trainer.distributed(r, 1, enabled=r.get("fsdp_version") is not None or bool(r.get("fsdp_config")))
    r.no_sync = no_sync.hint(r)  # it trains with the HF Trainer's loop
    r.finish(NO_EFFECT)


def _method(r: Reader) -> None:
    adapter = (r.text("adapter") or "").strip().lower()
    four, eight = r.flag("load_in_4bit") is True, r.flag("load_in_8bit") is True
    if adapter not in ("", "lora", "qlora"):
        r.ignore("adapter", f"{adapter[:20]} adapters are not modelled (llmem: lora, qlora)")
        return
    if not adapter:
        return
    if four or adapter == "qlora":
        r.set("adapter", "method", "qlora", "LoRA over a bitsandbytes 4-bit base")
        kwargs = r.section("bnb_config_kwargs")
        quant = str(kwargs.get("bnb_4bit_quant_type", "nf4")).lower()
        r.set("bnb_config_kwargs.bnb_4bit_quant_type", "quant", quant, "" if "bnb_4bit_quant_type" in kwargs else
              "axolotl's default 4-bit base: nf4")
        dq = kwargs.get("bnb_4bit_use_double_quant", True)
        r.set("bnb_config_kwargs.bnb_4bit_use_double_quant", "double_quant", dq, "" if
              "bnb_4bit_use_double_quant" in kwargs else "axolotl's default: double quantization on")
    elif eight:
        r.set("load_in_8bit", "method", "qlora", "LoRA over a bitsandbytes 8-bit (LLM.int8) base")
        r.set("load_in_8bit", "quant", "int8")
    else:
        r.set("adapter", "method", "lora")
    r.copy((("lora_r", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout")))
    if r.flag("lora_target_linear") is True:
        r.set("lora_target_linear", "lora_targets", "all-linear")
    else:
        common.targets(r, "lora_target_modules", r.get("lora_target_modules"))
    if r.has("lora_modules_to_save"):
        r.set("lora_modules_to_save", "lora_modules_to_save", r.get("lora_modules_to_save"))


def _precision(r: Reader) -> None:
    """axolotl loads the model in bf16 (fp16) when bf16 (fp16) is set: pure half weights under autocast."""
    if r.get("bf16") == AUTO and r.flag("fp16") is not True:
        r.set("bf16", "precision", "bf16", "'auto': axolotl loads the weights in bf16 on GPUs that support it "
              "(Ampere and newer); on older ones it is fp16: pass --precision fp16")
        return
    common.precision(r, "bf16", "fp16", True, "axolotl loads the weights in this dtype (its torch_dtype)",
                     "without bf16 or fp16 axolotl loads the weights in float32")


def _attention(r: Reader) -> None:
    name = r.text("attention") if r.has("attention") else None
    if name is not None and name.strip().lower() in ATTENTION_NAMES:
        r.set("attention", "attn", ATTENTION_NAMES[name.strip().lower()])
        return
    for key, attn in ATTENTION.items():
        if r.flag(key) is True:
            r.set(key, "attn", attn, "fused kernels keep no seq × seq matrices" if attn == "sdpa" else "")
            return
