"""LoRA via PEFT (DESIGN.md "Project extensions"): `peft.get_peft_model(model, LoraConfig(...))` on the built model,
before it is wrapped; only the adapters stay trainable.

QLoRA (`--method qlora --quant nf4|fp4`): first the frozen base is quantized exactly as transformers' bitsandbytes
quantizer does when it loads a model with `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=Q,
bnb_4bit_compute_dtype=<the plan's dtype>, bnb_4bit_use_double_quant=<--double-quant>)`: transformers'
`replace_with_bnb_linear` swaps every `nn.Linear` but the output layer for a `bnb.nn.Linear4bit`, and each weight is
quantized as its loader does, `bnb.nn.Params4bit(weight, requires_grad=False, **meta_param.__dict__).to(device)`.
(`from_config` does not run a quantizer; this is the same replacement and quantization, done on the built model.)
`peft.prepare_model_for_kbit_training` is not part of the program (see DESIGN.md).
Under `--precision bf16-mixed|fp16-mixed` (docs/MODEL-QLORA-MIXED.md) this is the common recipe's model:
`from_pretrained(..., dtype=<half>, quantization_config=<4-bit, compute dtype half>)` (each weight quantized from
its half values: the `quant_state.dtype` that `dequantize_4bit` returns in backward is half), then
`prepare_model_for_kbit_training`'s cast of every other parameter to fp32 (here: built in fp32).

`--quant int8` (LLM.int8): the same replacement with `BitsAndBytesConfig(load_in_8bit=True)` (llm_int8_threshold 6.0,
llm_int8_has_fp16_weight False) gives `bnb.nn.Linear8bitLt` modules, and each weight is quantized as transformers'
`Bnb8bitQuantize` does, `bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, **meta.__dict__).to(device)`
(int8 `CB` + fp32 row scales `SCB`); `model.is_loaded_in_8bit = True` makes PEFT dispatch its bnb 8-bit LoRA layers."""

from __future__ import annotations

import torch
from torch import nn

from llmem.plan import ALL_LINEAR, Method, Quant, TrainingPlan

NOT_CONVERTED = ("lm_head", "embed_out")  # transformers keeps the output embeddings unquantized


def lora_config(plan: TrainingPlan):
    from peft import LoraConfig

    targets = ALL_LINEAR if plan.lora_targets == ALL_LINEAR else plan.lora_targets.split(",")
    to_save = plan.lora_modules_to_save.split(",") if plan.lora_modules_to_save else None
    return LoraConfig(r=plan.lora_rank, lora_alpha=plan.lora_alpha, lora_dropout=plan.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM", modules_to_save=to_save)


def bnb_config(plan: TrainingPlan):
    from transformers import BitsAndBytesConfig

    if plan.quant is Quant.INT8:
        return BitsAndBytesConfig(load_in_8bit=True)  # llm_int8_threshold=6.0, llm_int8_has_fp16_weight=False
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=str(plan.quant),
                              bnb_4bit_compute_dtype=getattr(torch, plan.precision.compute_dtype_name),
                              bnb_4bit_use_double_quant=plan.double_quant,
                              bnb_4bit_quant_storage=quant_storage(plan))


def quant_storage(plan: TrainingPlan):
    """`bnb_4bit_quant_storage`: uint8, except under FSDP1, where FSDP-QLoRA recipes (PEFT's accelerate FSDP docs,
    Answer.AI's fsdp_qlora) store the packed codes in the base's half dtype so that a decoder layer's FlatParameter
    holds one dtype (bitsandbytes 0.50.2 `backends/default/ops.py:257`: the uint8 codes viewed as that dtype)."""
    from llmem.plan import Engine

    if plan.engine is Engine.FSDP1:
        return getattr(torch, plan.precision.compute_dtype_name)
    return torch.uint8


def quantize_base(model: nn.Module, plan: TrainingPlan) -> nn.Module:
    """Replace the base's Linears by bitsandbytes 4-bit (or 8-bit) Linears holding the quantized weights (in
    place)."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D

    # what `replace_with_bnb_linear` converts (`type(module) is nn.Linear` or a Conv1D, transformers 5.23
    # `integrations/bitsandbytes.py:189`); a Conv1D's (in, out) weight is quantized transposed, as the loader's
    # `Bnb4bitQuantize`/`Bnb8bitQuantize.convert` do (`if issubclass(module.source_cls, Conv1D): value = value.T`)
    converted = {name: m for name, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, Conv1D)}
    weights = {name: m.weight.data.T if isinstance(m, Conv1D) else m.weight.data for name, m in converted.items()}
    biases = {name: m.bias.data for name, m in converted.items() if m.bias is not None}
    converted.clear()
    skip = [n for n in weights if n.rsplit(".", 1)[-1] in NOT_CONVERTED]
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=bnb_config(plan))
    for name, module in model.named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and name in biases:
            # the loader fills a quantized Linear's bias as any other tensor: the same values, the model's dtype
            module.bias = nn.Parameter(biases.pop(name), requires_grad=False)
        if isinstance(module, bnb.nn.Linear4bit):
            value = weights.pop(name)
            if plan.precision.is_mixed:  # loaded in the half dtype (the quant_state's dtype), see the docstring
                value = value.to(getattr(torch, plan.precision.compute_dtype_name))
            meta = module.weight
            module.weight = bnb.nn.Params4bit(value, requires_grad=False, **meta.__dict__).to(value.device)
            del value
        elif isinstance(module, bnb.nn.Linear8bitLt):
            value = weights.pop(name)
            kwargs = dict(module.weight.__dict__)
            kwargs.pop("SCB", None)
            # Int8Params.to quantizes a CPU tensor not yet int8: CB int8 (out, in) becomes .data, SCB fp32 (out,)
            module.weight = bnb.nn.Int8Params(value.to("cpu"), requires_grad=False, **kwargs).to(value.device)
            del value
    weights.clear()
    biases.clear()
    # what transformers' quantizer sets; PEFT dispatches its bnb LoRA layers on it
    if plan.quant is Quant.INT8:
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    return model


def apply_method(model: nn.Module, plan: TrainingPlan) -> nn.Module:
    """The model the plan trains: itself for full fine-tuning, the PEFT model for LoRA and QLoRA."""
    if plan.method is Method.FULL:
        return model
    from peft import get_peft_model

    if plan.method is Method.QLORA:
        model = quantize_base(model, plan)
    # `--lora-adapter-dtype base`: PEFT skips its fp32 upcast (peft 0.21.2 `tuners/tuners_utils.py:2719`), leaving
    # the adapters in the base layer's dtype (`tuners/lora/layer.py:314`)
    autocast = plan.lora_adapter_dtype.value == "fp32"
    return get_peft_model(model, lora_config(plan), autocast_adapter_dtype=autocast)
