"""What a checkpointed decoder layer keeps alive beyond its saved tensors: the layer call's arguments that
`torch.utils.checkpoint` (`use_reentrant=False`) keeps for the recompute — `position_ids`, eager attention's float
masks (`eager_mask_held_saved`) — each until the backward of the lowest checkpointed layer taking it
(`eager_mask_released_bytes`); a derived architecture's traced arguments (`Derived.held_saved`). Re-exported by
`llmem.components.activations`."""

from __future__ import annotations

from llmem.components.saved import Saved, _bytes, _sdpa
from llmem.plan import GradCkpt, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def _checkpoints_layers(plan: TrainingPlan) -> bool:
    from llmem.components.activations import checkpoints_layers

    return checkpoints_layers(plan)


def checkpoint_held_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """What a checkpointed decoder layer keeps alive beyond its saved tensors: `torch.utils.checkpoint`
    (`use_reentrant=False`) keeps the layer call's arguments for the recompute (`recompute_fn` closes over
    `args`/`kwargs`), so the model forward's `position_ids` (1 × seq int64, `cache_position.unsqueeze(0)`; without
    checkpointing only RoPE's cos/sin derived from it survive the forward) lives until layer 0's backward — the
    first checkpointed layer. gpt2/opt save their position ids anyway (`outer_saved`). A derived architecture: the
    layers' tensor arguments no op saves, as traced."""
    if _checkpoints_layers(plan) and spec.derived is not None:
        return spec.derived.held_saved(plan)
    if not _checkpoints_layers(plan):
        return []
    items = eager_mask_held_saved(spec, plan)
    if spec.family.position_ids_held:
        items.append(Saved("position_ids (held by the checkpointed layers' inputs)", plan.seq_len * 8))
    return items


def eager_mask_held_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """Eager attention takes a float causal mask: transformers 5.23 `masking_utils.eager_mask` turns sdpa's boolean
    (micro-batch × 1 × seq × seq) mask into `torch.where(mask, 0, finfo(dtype).min)` in the embeddings' dtype (rb).
    The mask add saves nothing, so without checkpointing the mask dies with the model forward; a checkpointed layer
    keeps it as a kwarg of its recompute until layer 0's backward. A derived architecture's traced arguments
    (`checkpoint_held_saved`) include its masks."""
    if not _checkpoints_layers(plan) or _sdpa(spec, plan) or spec.derived is not None:
        return []
    _, rb = _bytes(plan)
    size = plan.batch_size * plan.seq_len * plan.seq_len * rb
    return [Saved(f"eager {kind} mask (held by the checkpointed layers' kwargs)", size)
            for kind in _mask_holders(spec, plan)]


@per_spec("layout_key")
def _mask_holders(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """The eager masks checkpointed layers hold, each with the lowest checkpointed layer taking it: gemma2 alternates
    sliding-window (even layers) and full attention (odd layers) and makes both (`Gemma2Model.forward`'s
    `causal_mask_mapping`, `Gemma2Config.layer_types`); the others make one causal mask (layer 0 is always
    checkpointed)."""
    if not spec.family.sliding_window_layers:
        return {"causal": 0}
    holders = {}
    for kind, parity in (("sliding-window causal", 0), ("causal", 1)):
        low = next((k for k in range(parity, spec.num_layers, 2) if plan.checkpointed(k)), None)
        if low is not None:
            holders[kind] = low
    return holders


@per_spec()
def eager_mask_released_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Of `eager_mask_held_saved`, the masks released before layer `layer`'s backward: a checkpointed layer's frame
    lets its kwargs go when its backward is done, so a mask lives until the backward of the lowest layer taking it.
    A derived architecture: any argument the checkpointed layers hold (`Derived.held_released_bytes`), and the
    shared saved tensors only layers above saved (`Derived.outer_released_bytes`)."""
    if spec.derived is not None:
        held = spec.derived.held_released_bytes(plan, layer) if plan.grad_ckpt is GradCkpt.FULL else 0
        return held + spec.derived.outer_released_bytes(plan, layer)
    masks = eager_mask_held_saved(spec, plan)
    return sum(s.bytes for s, low in zip(masks, _mask_holders(spec, plan).values(), strict=True)
               if low > layer) if masks else 0
