"""LoRA under FSDP1 wrapped as the FSDP-LoRA recipes wrap it (`--engine fsdp1 --fsdp1-wrap adapters`).

The recipes: Answer.AI fsdp_qlora `train.py` (049515f) `get_wrapping_policy`, PEFT 0.21.2 `utils/other.py`
`fsdp_auto_wrap_policy`, torchtune's `lora_fsdp_wrap_policy` (FSDP1 era). Each is an `_or_policy` of
  - a lambda policy: a leaf module (`len(list(module.named_children())) == 0`) with a `weight` that requires grad,
    i.e. every `lora_A.default` and `lora_B.default` Linear (bias-free: its weight only), and
  - `transformer_auto_wrap_policy` over the decoder layer classes,
with `use_orig_params=False` (Answer.AI's `FSDP(..., use_orig_params=False)`; PEFT's FSDP docs' config). So:
  units        the root (embeddings, final norm, lm_head), each decoder layer's frozen base, and one unit per
               adapter tensor (`adapter_units`, in forward order), each a FlatParameter padded to the world size
               only (`align_addresses = use_orig_params`: no 16-byte padding between tensors, torch 2.13
               `fsdp/_flat_param.py` `_init_flat_param_and_metadata`).
  frozen       the root's and the layers' FlatParameters require no grad (`_validate_tensors_to_flatten`: all
               tensors frozen), and under use_orig_params=False their views are plain tensors that require no grad
               either (`_use_unflat_views`): autograd computes no base weight gradient and each base op saves what
               one GPU's LoRA saves (LoRA's table, as the FSDP2 walk's LoRA compute). No flat gradient, no
               reduce-scatter for them; `_register_post_backward_reshard_only_hook` (`fsdp/_runtime_utils.py:1473`)
               reshards a frozen layer once its inputs' gradients are computed (a multi-grad hook), and the final
               callback (`_catch_all_reshard`) the units whose inputs need none (layer 0, the root).
  adapters     each adapter unit is gathered at its forward, freed after it (FULL_SHARD), gathered again at its
               pre-backward; its flat gradient (N elements, the gather dtype) is reduce-scattered by its own
               post-backward hook right after its AccumulateGrad, so at most one adapter's unsharded gradient is
               alive; its gradient shard (S, the parameter dtype; under MixedPrecision the cast copy) stays to the
               step. The optimizer steps the FlatParameter shards (S elements each, padding included):
               `flat_param.optimized_sizes`.
  QLoRA        the layer units hold the bf16-stored 4-bit codes (`flat_qlora.stored_params`) and the norms, frozen.
  prefetch     BACKWARD_PRE prefetches the handle before the current one in post-forward order
               (`_exec_order_utils.py:88` `get_handle_to_backward_prefetch`): a layer's adapters finish their
               forward before the layer, so the root's pre-backward prefetches the last layer, a layer's
               pre-backward its own last adapter, and its first adapter's (q_proj's lora_A) pre-backward the layer
               below: two layers gathered from then to the end of the layer's backward (`walk.fsdp1_adapters`).
"""

from __future__ import annotations

from llmem.components import lora
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, ParamTensor


def wraps_adapters(plan: TrainingPlan) -> bool:
    """`--fsdp1-wrap adapters` under LoRA with `--engine fsdp1`."""
    from llmem.plan import Engine

    return plan.engine is Engine.FSDP1 and lora.is_lora(plan) and plan.fsdp1_wrap.value == "adapters"


def adapter_units(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """The adapter tensors that are units of their own, in forward order (per layer: each targeted Linear's
    lora_A, then lora_B); none unless `wraps_adapters`."""
    return lora.adapter_params(spec, plan) if wraps_adapters(plan) else []


def first_unit(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Index of the first adapter unit in `flat_param.units` (after the root and the layers)."""
    return 1 + spec.num_layers


def layer_adapter_units(spec: ModelSpec, plan: TrainingPlan, layer: int) -> list[int]:
    """Indices in `flat_param.units` of decoder layer `layer`'s adapter units."""
    start = first_unit(spec, plan)
    return [start + i for i, a in enumerate(adapter_units(spec, plan)) if a.layer == layer]


def layer_grad_shard_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """The gradient shards the layer's adapter units keep to the step (`_saved_grad_shard`, then `.grad`): S
    elements each in the parameter dtype (`flat_param.shard_bytes`)."""
    from llmem.components.flat_param import shard_bytes

    shards = shard_bytes(spec, plan)
    return sum(shards[u] for u in layer_adapter_units(spec, plan, layer))


def largest_reduce_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Inside one adapter's post-backward hook: its unsharded flat gradient, the reduce-scatter's buffers
    (`flat_param.reduce_scatter_bytes`) and the cast (`cast_grad_bytes`), for the layer's largest adapter."""
    from llmem.components import flat_param as fp

    return max((fp.unsharded_grad_bytes(spec, plan, u) + fp.reduce_scatter_bytes(spec, plan, u)
                + fp.cast_grad_bytes(spec, plan, u) for u in layer_adapter_units(spec, plan, layer)), default=0)


def largest_gather_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """One adapter unit's all-gather inside the layer's forward or backward: its `_full_param_padded` and the
    gather's transients (`flat_param.gather_transient_bytes`), for the layer's largest adapter."""
    from llmem.components import flat_param as fp

    unsharded = fp.unsharded_bytes(spec, plan)
    return max((unsharded[u] + fp.gather_transient_bytes(spec, plan, u)
                for u in layer_adapter_units(spec, plan, layer)), default=0)


def layers_unsharded_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """Per decoder layer, its adapter units' `_full_param_padded` bytes (N elements in the gather dtype each):
    SHARD_GRAD_OP keeps them gathered from their forward to their post-backward, as the layers' own
    (`_post_forward_reshard` skips them, `fsdp/_runtime_utils.py`); nothing outside the adapters wrap."""
    from llmem.components.flat_param import unsharded_bytes

    return spec.memo(("flat_adapters.unsharded", plan.layout_key), lambda: tuple(
        sum(unsharded_bytes(spec, plan)[u] for u in layer_adapter_units(spec, plan, layer))
        for layer in range(spec.num_layers)), per_plan=True)
