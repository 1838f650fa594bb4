"""LoRA via PEFT (DESIGN.md "Project extensions"): `peft.get_peft_model(model, LoraConfig(...))` on the built model,
before it is wrapped; only the adapters stay trainable."""

from __future__ import annotations

from torch import nn

from llmem.plan import ALL_LINEAR, Method, TrainingPlan


def lora_config(plan: TrainingPlan):
    from peft import LoraConfig

    targets = ALL_LINEAR if plan.lora_targets == ALL_LINEAR else plan.lora_targets.split(",")
    return LoraConfig(r=plan.lora_rank, lora_alpha=plan.lora_alpha, lora_dropout=plan.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")


def apply_method(model: nn.Module, plan: TrainingPlan) -> nn.Module:
    """The model the plan trains: itself for full fine-tuning, the PEFT model for LoRA."""
    if plan.method is not Method.LORA:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config(plan))
