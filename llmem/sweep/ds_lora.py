"""LoRA under DeepSpeed in the sweep's draws (pure, torch-free): the plans `llmem.components.ds_lora` models —
LoRA in fp32 under ZeRO-0/1/2 without --lora-modules-to-save; where the gradient hooks reduce inside the LoRA
layers (ZeRO-2, ZeRO-1 under overlap_comm) with --lora-dropout 0 (`llmem.support`: with dropout the one-device LoRA
walk's down_proj backward is an intermediate gradient over), which a drawn plan there is set to. A mixture-of-experts
model drawn so is refused by the estimate as a gap (`ds_lora.check`) and recorded as such."""

from __future__ import annotations


def lora_modelled(fields: dict) -> bool:
    """A LoRA plan DeepSpeed's engine is modelled for (its ZeRO stage and precision)."""
    return fields["method"] == "lora" and fields["precision"] == "fp32" and fields["zero"] in (0, 1, 2) \
        and not fields.get("lora_modules_to_save")


def lora_settings(fields: dict, overlap: bool) -> dict:
    """What a LoRA plan drawn for DeepSpeed is set to: --lora-dropout 0 where the hooks reduce in backward."""
    if fields["method"] != "lora" or not (fields["zero"] == 2 or overlap):
        return {}
    return {"lora_dropout": 0.0}
