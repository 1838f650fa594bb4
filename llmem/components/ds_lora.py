"""LoRA under DeepSpeed ZeRO-0/1/2 (`--engine deepspeed --method lora`, fp32): the PEFT model passed to
`deepspeed.initialize` with a torch optimizer over its trainable parameters, as the HF Trainer does. DeepSpeed 0.19.0's
ZeRO optimizer flattens only the parameters that require a gradient (`runtime/zero/stage_1_and_2.py` :376-383,
`trainable_parameters = [param for param in param_group['params'] if param.requires_grad]`), registers its
gradient hooks on them only (`create_gradient_handling_hooks` :1046, `if param.requires_grad`) and partitions the
adapters; the frozen base stays the module's own tensors. ZeRO-0's all-reduce takes the parameters with a gradient
(engine.py `buffered_allreduce_fallback` :3067, `param.grad is None` skipped).

So every ZeRO term of `zero_ds` and `deepspeed_hooks` reads the adapters in place of the model's parameters: a view
of the spec whose layer and outer tensors are PEFT's lora_A / lora_B (`lora.adapter_params`, in `model.parameters()`
order: per targeted Linear in registration order, A then B), beside the frozen base in the module's dtype."""

from __future__ import annotations

from llmem.components import lora
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor


class TrainableView:
    """The parts of a `ModelSpec` the ZeRO terms read, over the tensors DeepSpeed's optimizer flattens."""

    def __init__(self, spec: ModelSpec, params: list[ParamTensor]) -> None:
        self.base, self.num_layers, self.vocab_size = spec, spec.num_layers, spec.vocab_size
        self.model_type = spec.model_type
        groups: dict = {}
        for p in params:
            groups.setdefault(p.layer, []).append(p)
        self._by_layer = {k: tuple(v) for k, v in groups.items()}
        self._memo: dict = {}

    def memo(self, key: tuple, compute, per_plan: bool = False):
        """`ModelSpec.memo` for the view (one view per estimate)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def layer_params(self, layer: int) -> tuple[ParamTensor, ...]:
        return self._by_layer.get(layer, ())

    @property
    def outer_params(self) -> tuple[ParamTensor, ...]:
        return self._by_layer.get(None, ())


def trainable_spec(spec: ModelSpec, plan: TrainingPlan) -> ModelSpec | TrainableView:
    """The spec itself under full fine-tuning; under LoRA the view over its adapters."""
    if plan.method is Method.FULL:
        return spec
    return TrainableView(spec, lora.adapter_params(spec, plan))


def frozen_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The frozen base's elements (the module's own tensors beside the flat adapters): 0 under full fine-tuning."""
    return 0 if plan.method is Method.FULL else spec.total_params
