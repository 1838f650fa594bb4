"""QLoRA under FSDP1 (`--engine fsdp1 --method qlora --precision bf16 --lora-adapter-dtype base`): the 4-bit base
as FSDP-QLoRA recipes store it (PEFT's accelerate FSDP docs, Answer.AI's fsdp_qlora, transformers'
`BitsAndBytesConfig(bnb_4bit_quant_storage=bf16)`), flattened by FSDP1 with the layer's other bf16 tensors.

- Codes: bitsandbytes 0.50.2 `backends/default/ops.py:257` packs two 4-bit codes per byte, ceil(numel / 2) bytes,
  then views them as the storage dtype: a `Params4bit` of shape (ceil(numel / 2) / pb, 1) in bf16
  (`packed_param`). FSDP1 flattens it like any bf16 tensor of that numel (`flat_param.unit_params`): its shard,
  its all-gathered copy, its padding to 16 bytes.
- quant_state: no parameter; `Params4bit._quantize` (`nn/modules.py:391-393`) gives it to the `Linear4bit`
  module (`module.quant_state`), which FSDP1 does not touch: the fp32 absmax (or, double-quantized, the uint8
  absmax with their own scales) and the code table whole on every rank (`quant.quant_state_bytes`, as FSDP2's).
- Forward: with `use_orig_params` the module's weight is a plain view of the gathered flat parameter;
  `Linear4bit.forward` finds no `quant_state` on it and wraps it (`fix_4bit_weight_quant_state_from_module`,
  `nn/modules.py:487-501`: `Params4bit(module.weight, ...)`, `_make_subclass` of the view: the same storage,
  detached, requires no grad) with the module's, so the dequantized-weight moments are the single-GPU ones and
  no gradient reaches the codes' views. The other views of the unit (the norms' weights, the adapters) require grad
  (the FlatParameter does, `_flat_param.py:832`): the norms' weight gradients are computed, and their `weight * x`
  saves x (`norm_weight_saved_bytes`).
- Backward: the views' gradients (norm weights and adapters, bf16) wait in `SplitWithSizesBackward`, which fills
  the codes' (and padding's) missing gradients with zero tensors before its `cat` (`view_gradient_bytes`): the
  unsharded flat gradient is N elements, reduce-scattered into the shard S as under full fine-tuning; the optimizer
  steps the adapters' views of the shard only (`_use_sharded_grad_views`: a frozen view gets no `.grad`).
"""

from __future__ import annotations

from llmem.components import quant
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, ParamTensor


def applies(plan: TrainingPlan) -> bool:
    from llmem.plan import Engine

    return plan.engine is Engine.FSDP1 and quant.is_qlora(plan)


def packed_param(p: ParamTensor, plan: TrainingPlan) -> ParamTensor:
    """A 4-bit weight as FSDP1 flattens it: its packed codes viewed as the parameter dtype, (ceil(numel / 2) / pb, 1)
    (`backends/default/ops.py:257`: `packed.squeeze().view(quant_storage).unsqueeze(1)`)."""
    return ParamTensor(p.name, (-(-p.numel // 2) // plan.precision.param_bytes, 1), p.layer, p.tp_split)


def stored_params(spec: ModelSpec, plan: TrainingPlan, params: list[ParamTensor]) -> list[ParamTensor]:
    """`params` with each 4-bit weight replaced by its packed codes (`packed_param`)."""
    if not applies(plan):
        return params
    quantized = {p.name for p in quant.quantized_weights(spec, plan)}
    return [packed_param(p, plan) if p.name in quantized else p for p in params]


def view_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Decoder layer `layer`'s views' gradients as `SplitWithSizesBackward` concatenates them (torch 2.13
    `torch/csrc/autograd/FunctionsManual.cpp` `split_with_sizes_backward`, declared at `FunctionsManual.h:448`): the
    norms' weights' and the adapters' from autograd, and a zero tensor for each segment that got none (the codes'
    views, the padding) made beside them just before the `cat`: N elements in the flat parameter's dtype in all
    (measured on CPU: one `aten::empty` per code view alive with the cat's output)."""
    from llmem.components.flat_param import unsharded_grad_bytes

    return unsharded_grad_bytes(spec, plan, 1 + layer)


def norm_weight_saved_bytes(spec: ModelSpec, cp: TrainingPlan) -> int:
    """What a decoder layer's norms save because their weights' views require grad: each `weight * x` saves x, the
    normalized input in the compute dtype (full fine-tuning's `.normalized` entries, which LoRA's table leaves out:
    `lora_activations._DROPPED`)."""
    from llmem.components import activations as act

    return sum(s.bytes for s in act.layer_saved(spec, cp) if s.name.endswith(".normalized"))


def first_layer_saving_bytes(spec: ModelSpec, cp: TrainingPlan, half: bool) -> int:
    """How much less layer 0 keeps than the others: its input (the frozen embeddings' output) requires no grad, but
    its input norm's output does (the norm weight's view does), so everything after that norm saves as in any
    layer; only the entries the input's gradient needs are missing (`lora_activations._NEEDS` "input": the norm's
    fp32 copy and rsqrt). (One GPU's QLoRA, `lora.first_layer_saving_bytes`, misses the adapters' dropout masks too.)"""
    from llmem.components import lora
    from llmem.components.lora_activations import _NEEDS

    return sum(s.bytes for s in lora.layer_saved(spec, cp, first=False, half=half) if _NEEDS.get(s.name) == "input")
