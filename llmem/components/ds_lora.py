"""LoRA under DeepSpeed ZeRO-0/1/2 (`--engine deepspeed --method lora`, fp32 and bf16-mixed): the PEFT model passed to
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
    """The spec itself under full fine-tuning; under LoRA the view over its adapters and PEFT's trainable module
    copies (`--lora-modules-to-save`: `lora.module_copies`, the embeddings' first and the lm_head's last in
    `model.parameters()` order, each in the module's dtype), the tensors the optimizer gets."""
    if plan.method is Method.FULL:
        return spec
    return TrainableView(spec, [*lora.adapter_params(spec, plan), *lora.module_copies(spec, plan)])


def walk_spec(spec: ModelSpec, plan: TrainingPlan) -> ModelSpec:
    """The spec the one-device walk of DeepSpeed's compute reads. Under bf16 the engine casts the whole module, PEFT's
    fp32 adapters included, to bf16 (engine.py `_configure_distributed_model` :1463, `self.module.bfloat16()`, after
    `get_peft_model`), so the adapters compute in the half dtype: `x.to(lora_A.weight.dtype)` is a no-op, lora_A
    saves the half x, lora_B the half A output (`lora_activations.layer_saved`'s `half`, as under FSDP2's
    MixedPrecisionPolicy; traced tables: `Derived.with_half_adapters`). Other plans keep `spec`."""
    if plan.method is Method.FULL or plan.precision.value != "bf16-mixed":
        return spec
    return half_spec(spec)


def half_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` with half adapters (`spec.half_adapters`; traced tables: `Derived.with_half_adapters`), memoized."""
    return spec.memo(("half adapters spec",), lambda: _half(spec))


def _half(spec: ModelSpec) -> ModelSpec:
    import dataclasses

    derived = None if spec.derived is None else spec.derived.with_half_adapters()
    out = dataclasses.replace(spec, half_adapters=True, derived=derived)
    if hasattr(spec, "source_config"):  # (set after construction, `ModelSpec.from_config`)
        object.__setattr__(out, "source_config", spec.source_config)
    return out


def frozen_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The frozen base's elements (the module's own tensors beside the flat adapters): 0 under full fine-tuning."""
    return 0 if plan.method is Method.FULL else spec.total_params


def last_mlp_adapter(name: str, spec: ModelSpec, layer: int) -> bool:
    """Whether adapter `name` adapts layer `layer`'s last MLP Linear (down_proj, c_proj, fc2): its lora_B and lora_A
    hooks run before the MLP's moment (their MmBackward0s first, then the frozen base's input gradient; measured on
    a per-hook timeline of DeepSpeed 0.19.0's `reduce_independent_p_g_buckets_and_remove_grads`, llama, 2 ranks)."""
    from llmem.components import weight_gradient as wgrad

    module = wgrad.last_mlp_weight_name(spec).rsplit(".", 1)[0].replace(".0.", f".{layer}.", 1)
    return name.startswith(f"{module}.lora_")


def without_mlp_adapter_gradients(spec: ModelSpec, plan: TrainingPlan, phases: list, mlp_moment) -> list:
    """The one-device moments with the gradients freed at their hooks, less the last MLP Linear's adapter gradients
    the LoRA MLP moment keeps (`lora.largest_mlp_adapter_bytes`, in `gradients.layer_backward_peak_extra_bytes`):
    under ZeRO-2 / overlap_comm their hooks have copied them into the bucket (stage_1_and_2.py :1118-1120) or hold
    a tensor larger than the bucket as its own gradient, which `deepspeed_hooks._held` counts."""
    from llmem.components import Category
    from llmem.walk.phase import Phase

    adapters = lora.largest_mlp_adapter_bytes(spec, plan)
    out = []
    for ph in phases:
        if adapters and mlp_moment.fullmatch(ph.name):
            ph = Phase(ph.name, {**ph.breakdown, Category.GRADIENTS: ph.breakdown[Category.GRADIENTS] - adapters})
        out.append(ph)
    return out


def check(spec: ModelSpec, plan: TrainingPlan) -> None:
    """LoRA under ZeRO-2 / overlap_comm is measured on dense models; a mixture-of-experts layer's adapter hooks are
    placed by the MLP-moment bound only (mixtral all-linear, s64, 2 ranks: +1.86%), a gap; so is PEFT's dropout
    where `lora_forward` does not model its forward moment."""
    from llmem.components import zero_ds as z
    from llmem.errors import GAP, InputError

    if plan.engine.value == "deepspeed" and plan.method is Method.LORA and plan.zero == 3:
        from llmem.walk import deepspeed3_lora

        return deepspeed3_lora.check(spec, plan)
    if not (plan.engine.value == "deepspeed" and plan.method is Method.LORA and z.reduces_in_backward(plan)):
        return
    if spec.is_moe:
        raise InputError("engine", f"LoRA under DeepSpeed ZeRO-2 / overlap_comm is modelled on dense models; "
                         f"{spec.model_type!r}'s expert layers are not (measured +1.9% on mixtral): use ZeRO-0/1 "
                         "without overlap_comm, or --engine torch", GAP)
    from llmem.components import lora_forward

    if plan.lora_dropout > 0 and not lora_forward.applies(spec, plan):
        raise InputError("lora-dropout", "LoRA under DeepSpeed ZeRO-2 / overlap_comm with --lora-dropout > 0 is "
                         "measured in fp32 on gated-MLP models with down_proj adapted (`lora_forward`); use "
                         "--lora-dropout 0, or ZeRO-0/1 without overlap_comm", GAP)
