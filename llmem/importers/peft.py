"""PEFT `adapter_config.json` (`LoraConfig.save_pretrained`): rank, alpha, dropout, target modules and
modules_to_save; the base model is reported (and used when it is a preset)."""

from __future__ import annotations

from llmem.importers import common
from llmem.importers.core import Reader

NAME = "PEFT adapter_config.json"
NO_EFFECT = frozenset("""
task_type inference_mode peft_type revision auto_mapping init_lora_weights use_rslora fan_in_fan_out
lora_bias exclude_modules layer_replication megatron_config megatron_core runtime_config trainable_token_indices
eva_config corda_config loftq_config alora_invocation_tokens qalora_group_size use_qalora target_parameters
""".split())


def matches(tree: dict, name: str) -> bool:
    return name.lower().endswith("adapter_config.json") or ("peft_type" in tree and "r" in tree)


def read(r: Reader) -> None:
    kind = (r.text("peft_type") or "LORA").strip().upper()
    if kind != "LORA":
        r.ignore("peft_type", f"{kind} adapters are not modelled (llmem: LoRA)", kind)
        r.finish(NO_EFFECT)
        return
    r.set("peft_type", "method", "lora", "PEFT LoRA adapters on a frozen base; a quantized base is --method qlora "
          "--quant, or the trainer's file", shown=r.get("peft_type", "LORA"))
    r.copy((("r", "lora_rank"), ("lora_dropout", "lora_dropout")))
    alpha = r.get("lora_alpha")
    if isinstance(alpha, float) and not alpha.is_integer():
        r.ignore("lora_alpha", "llmem takes a whole alpha; it has no effect on memory")
    elif alpha is not None:
        r.set("lora_alpha", "lora_alpha", alpha)
    common.targets(r, "target_modules", r.get("target_modules"))
    if r.has("modules_to_save"):
        r.set("modules_to_save", "lora_modules_to_save", r.get("modules_to_save"))
    common.model(r, "base_model_name_or_path")
    if r.get("use_dora") is True:
        r.ignore("use_dora", "DoRA's magnitude vectors and their activations are not modelled; estimated as LoRA")
    for key in ("layers_to_transform", "rank_pattern", "alpha_pattern"):
        if r.get(key):
            r.ignore(key, "llmem adapts every layer with one rank" if key != "alpha_pattern" else
                     "no effect on memory")
    if r.get("bias") not in (None, "none"):
        r.ignore("bias", "trained biases are not modelled (a few MB)")
    r.finish(NO_EFFECT)
