"""FSDP1's flat parameters (`--engine fsdp1`, torch 2.13 `torch/distributed/fsdp/_flat_param.py`): the sizes of one
rank's tensors, each a small function with its source.

Units: accelerate's `transformer_auto_wrap_policy` wraps each decoder layer, and the root takes what is left (the
embeddings, the final norm, an untied lm_head). Each unit is one `FlatParameter`
(`FlatParamHandle._init_flat_param_and_metadata`): its tensors in registration order, and with `use_orig_params=True`
(`align_addresses`) each preceded by padding to a multiple of `_get_aligned_numel(param_dtype)` = 16 bytes /
element size, and the whole padded to a multiple of the world size W. N = that padded numel.
  shard        `FlatParamHandle.shard` / `_get_shard`: rank r keeps elements [r·N/W, (r+1)·N/W) — S = N/W (the
               parameter dtype), persistent.
  unsharded    `init_flat_param_attributes` / `_alloc_padded_unsharded_flat_param`: `_full_param_padded`, N
               elements in `MixedPrecision.param_dtype` (the parameter dtype without it), allocated at each unshard
               and freed at each reshard (`_free_storage`).
  mp shard     `_use_low_precision_shard`: under MixedPrecision the shard is cast to param_dtype into `_mp_shard`
               (S elements) before the all-gather and freed after it (`_free_low_precision_sharded_param`).
  gloo output  (CPU profile) `_all_gather_flat_param` calls `dist.all_gather(chunks, shard)` on CPU tensors; gloo's
               `AsyncAllgatherWork` gathers into a flat tensor of N elements it allocates, then copies out.
  grad shard   `_reduce_grad` / `_get_reduce_scatter_tensors`: `new_sharded_grad = empty_like(chunk)` (S elements,
               reduce dtype); `_cast_grad_to_param_dtype` casts it to the parameter dtype when they differ; kept
               as `_saved_grad_shard`, then `.grad` (`prepare_gradient_for_optim`) until `zero_grad` and the next
               root pre-forward (`_reset_flat_param_grad_info_if_needed`).
  optimizer    the original parameters are views of the rank's part of the shard (`_use_sharded_views`): a tensor
               outside the shard is empty and gets no gradient, so no state.
NO_SHARD (--zero 0): the flat parameter stays whole (S = N, still padded to W); nothing is all-gathered. Under
MixedPrecision the `_mp_shard` (N elements, half) is the unsharded parameter: allocated in `pre_unshard`, freed in
`post_reshard` (after forward, after backward), so it plays the gathered buffer's part. `_reduce_grad_no_shard`
all-reduces the flat gradient in place and `_cast_grad_to_param_dtype` casts it whole to the parameter dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.components import lora
from llmem.plan import Device, Scheme, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, per_spec

ALIGNMENT_BYTES = 16  # `_get_aligned_numel`: "This alignment constraint comes from TorchInductor"


@dataclass(frozen=True)
class FlatUnit:
    """One FlatParameter: its tensors' (offset, numel) in the unsharded flat tensor, and its padded numel N."""

    params: tuple[tuple[int, int], ...]
    numel: int

    def shard_numel(self, world: int) -> int:
        """S = N / W (`_get_shard`: N is already a multiple of W)."""
        return self.numel // world

    def in_shard(self, rank: int, world: int) -> list[int]:
        """Elements of each tensor that rank `rank` holds (`_get_shard_metadata`), zero for the tensors outside."""
        s = self.shard_numel(world)
        lo, hi = rank * s, (rank + 1) * s
        return [max(0, min(hi, off + n) - max(lo, off)) for off, n in self.params]


def sharded(plan: TrainingPlan) -> bool:
    """SHARD_GRAD_OP (ZeRO-2) and FULL_SHARD (ZeRO-3) shard; NO_SHARD (ZeRO-0) keeps the flat parameter whole."""
    return plan.scheme in (Scheme.ZERO2, Scheme.ZERO3)


def shard_world(plan: TrainingPlan) -> int:
    """The ranks a flat parameter is split over: W when sharded, 1 under NO_SHARD (padded to W all the same)."""
    return plan.dp if sharded(plan) else 1


def aligned_numel(plan: TrainingPlan) -> int:
    """`_get_aligned_numel(unsharded_dtype=_fwd_bwd_param_dtype)`: 16 bytes in the compute dtype's elements; with
    use_orig_params=False (`--fsdp1-wrap adapters`) `align_addresses` is off: no padding between tensors."""
    from llmem.components.flat_adapters import wraps_adapters

    return 1 if wraps_adapters(plan) else ALIGNMENT_BYTES // gather_bytes(plan)


def flatten(params: list[ParamTensor], align: int, world: int) -> FlatUnit:
    """`_init_flat_param_and_metadata`: alignment padding before each tensor, world-size padding at the end."""
    total, out = 0, []
    for p in params:
        total += -total % align
        out.append((total, p.numel))
        total += p.numel
    return FlatUnit(tuple(out), total + (-total % world))


def unit_params(spec: ModelSpec, plan: TrainingPlan, layer: int | None) -> list[ParamTensor]:
    """A unit's tensors in `module.parameters()` order (None: the root's). LoRA: PEFT's `LoraLayer` registers
    `base_layer` first, then `lora_A` and `lora_B`, so each adapter pair follows its base Linear's tensors."""
    from llmem.components.flat_adapters import wraps_adapters
    from llmem.components.flat_qlora import stored_params  # QLoRA: the 4-bit weights' packed codes

    base = stored_params(spec, plan, list(spec.outer_params if layer is None else spec.layer_params(layer)))
    if not lora.is_lora(plan) or wraps_adapters(plan):  # adapters wrap: the adapters are units of their own
        return base
    after: dict[str, list[ParamTensor]] = {}
    for a in lora.adapter_params(spec, plan):
        if a.layer == layer:
            after.setdefault(a.name.split(".lora_", 1)[0], []).append(a)
    out = []
    for p in base:
        out.append(p)
        module = p.name.rsplit(".", 1)[0]
        if p is next(q for q in reversed(base) if q.name.rsplit(".", 1)[0] == module):  # its module's last tensor
            out += after.pop(module, [])
    return out


@per_spec("layout_key")
def units(spec: ModelSpec, plan: TrainingPlan) -> tuple[FlatUnit, ...]:
    """The root's FlatParameter, then each decoder layer's (`--fsdp1-wrap adapters`: then each adapter's,
    `flat_adapters.adapter_units`)."""
    from llmem.components.flat_adapters import adapter_units

    align = aligned_numel(plan)
    return tuple(flatten(unit_params(spec, plan, layer), align, plan.dp) for layer in (None, *range(spec.num_layers))
                 ) + tuple(flatten([a], align, plan.dp) for a in adapter_units(spec, plan))


@per_spec("layout_key")
def trainable(spec: ModelSpec, plan: TrainingPlan) -> tuple[tuple[bool, ...], ...]:
    """Per unit (root first), whether each tensor requires grad: every one under full fine-tuning, the adapters'
    under LoRA (`_validate_tensors_to_flatten`: the FlatParameter requires grad if any of its tensors does)."""
    from llmem.components.flat_adapters import adapter_units

    if not lora.is_lora(plan):
        return tuple(tuple(True for _ in u.params) for u in units(spec, plan))
    return tuple(tuple(".lora_" in p.name for p in unit_params(spec, plan, layer))
                 for layer in (None, *range(spec.num_layers))) + tuple((True,) for _ in adapter_units(spec, plan))


def requires_grad(spec: ModelSpec, plan: TrainingPlan, unit: int) -> bool:
    """Whether unit `unit`'s FlatParameter requires grad (`_validate_tensors_to_flatten`, torch 2.13
    `_flat_param.py:832`: the OR over its tensors). Under LoRA the root (embeddings, final norm, lm_head) is frozen
    whole: no gradient, no reduce-scatter. A layer holding adapters requires grad whole: its views of the frozen
    base, `split(...).view(...)` of the flat parameter (`_get_unflat_views_aligned`, `_flat_param.py:1935`), require
    grad too, so autograd computes the frozen weights' gradients like full fine-tuning's."""
    return any(trainable(spec, plan)[unit])


def gather_bytes(plan: TrainingPlan) -> int:
    """Bytes per unsharded element: `MixedPrecision.param_dtype` (the half dtype), else the parameters' dtype."""
    return plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes


def reduce_bytes(plan: TrainingPlan) -> int:
    """Bytes per reduce-scatter element: `reduce_dtype` = param_dtype (accelerate's `set_mixed_precision`)."""
    return gather_bytes(plan)


@per_spec("layout_key")
def shard_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """Each unit's shard (root first), parameter dtype: the sharded parameters, and the sharded gradients."""
    return tuple(u.shard_numel(shard_world(plan)) * plan.precision.param_bytes for u in units(spec, plan))


@per_spec("layout_key")
def unsharded_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """Each unit's `_full_param_padded` (root first): N elements in the gather dtype. NO_SHARD: its `_mp_shard`
    under MixedPrecision (N half elements), nothing without (the flat parameter itself computes)."""
    if not sharded(plan) and not plan.precision.is_mixed:
        return tuple(0 for _ in units(spec, plan))
    return tuple(u.numel * gather_bytes(plan) for u in units(spec, plan))


def gather_transient_bytes(spec: ModelSpec, plan: TrainingPlan, unit: int) -> int:
    """Inside unit `unit`'s all-gather, beside its new `_full_param_padded`: the `_mp_shard` under MixedPrecision
    and, on CPU, gloo's flat output (N elements, the gather dtype)."""
    if not sharded(plan):  # NO_SHARD: the `_mp_shard` is the unsharded parameter, nothing is gathered
        return 0
    u = units(spec, plan)[unit]
    mp = u.shard_numel(plan.dp) * plan.precision.compute_bytes if plan.precision.is_mixed else 0
    gloo = u.numel * gather_bytes(plan) if plan.device is Device.CPU else 0
    return mp + gloo


def reduce_scatter_bytes(spec: ModelSpec, plan: TrainingPlan, unit: int) -> int:
    """Inside unit `unit`'s reduce-scatter, beside its unsharded gradient (`flat_param.grad`, N elements, the gather
    dtype): `new_sharded_grad` (S, reduce dtype) and, on CPU, gloo's clone of the input (N, reduce dtype:
    ProcessGroupGloo has no reduce-scatter, it all-reduces a copy); NCCL (CUDA profile) reduce-scatters in place."""
    if not sharded(plan):  # NO_SHARD: `dist.all_reduce(flat_param.grad)` in place
        return 0
    u = units(spec, plan)[unit]
    clone = u.numel * reduce_bytes(plan) if plan.device is Device.CPU else 0
    return u.shard_numel(plan.dp) * reduce_bytes(plan) + clone


def cast_grad_bytes(spec: ModelSpec, plan: TrainingPlan, unit: int) -> int:
    """`_cast_grad_to_param_dtype`: the new parameter-dtype shard beside the reduce-dtype one (MixedPrecision).
    NO_SHARD casts the flat gradient itself (counted apart): only the new N elements."""
    if reduce_bytes(plan) == plan.precision.param_bytes:
        return 0
    u = units(spec, plan)[unit]
    if not sharded(plan):
        return u.numel * plan.precision.param_bytes
    return u.shard_numel(plan.dp) * (reduce_bytes(plan) + plan.precision.param_bytes)


def unsharded_grad_bytes(spec: ModelSpec, plan: TrainingPlan, unit: int) -> int:
    """The unit's unsharded flat gradient: autograd's `SplitWithSizesBackward` of the views, N elements in the gather
    dtype (the padding's gradient zeros)."""
    return units(spec, plan)[unit].numel * gather_bytes(plan)


@per_spec("layout_key")
def largest_rank(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The rank whose optimizer steps the most elements (`optimized_sizes`): full fine-tuning, rank 0 or the last
    (the padding sits at the tensors' ends and the flat end); LoRA, any rank (the adapters sit by their Linears)."""
    world, steps = shard_world(plan), trainable(spec, plan)
    ranks = range(world) if lora.is_lora(plan) else sorted({0, world - 1})
    held = {r: sum(n for u, t in zip(units(spec, plan), steps, strict=True)
                   for n, on in zip(u.in_shard(r, world), t, strict=True) if on) for r in ranks}
    return max(held, key=lambda r: (held[r], -r))


@per_spec("layout_key")
def optimized_sizes(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """Elements of each original parameter on the rank holding the most (the ranks differ only by padding), the
    root's tensors first: the tensors the optimizer steps (empty ones get no gradient and no state; under LoRA the
    adapters only: `_use_sharded_grad_views` gives a frozen view no `.grad`, `_flat_param.py:2209`)."""
    from llmem.components.flat_adapters import wraps_adapters

    world, steps = shard_world(plan), trainable(spec, plan)
    if wraps_adapters(plan):  # use_orig_params=False: the optimizer steps each adapter unit's FlatParameter shard
        return [u.shard_numel(world) for u, t in zip(units(spec, plan), steps, strict=True) if all(t)]
    rank = largest_rank(spec, plan)
    return [n for u, t in zip(units(spec, plan), steps, strict=True)
            for n, on in zip(u.in_shard(rank, world), t, strict=True) if n and on]
