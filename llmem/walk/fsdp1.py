"""The walk of FSDP1 (`--engine fsdp1`: `FullyShardedDataParallel`, ZeRO-0 = NO_SHARD, ZeRO-2 = SHARD_GRAD_OP,
ZeRO-3 = FULL_SHARD, as accelerate configures it: `use_orig_params`, `limit_all_gathers`, BACKWARD_PRE, no forward
prefetch), torch 2.13 `torch/distributed/fsdp/_runtime_utils.py`. The compute (activations, logits, a layer's
gradients of its views) is the FSDP2 walk's compute plan (`fsdp.compute_plan`: MixedPrecision runs the whole forward
in the half dtype, no autocast); the buffers are FSDP1's flat ones (`llmem.components.flat_param`). In order:
  forward     `_root_pre_forward` gathers the root (R) and keeps it to the end of backward (`_post_forward_reshard`
              never frees the root's); each layer's `_pre_forward_unshard` gathers it (A), FULL_SHARD frees it in
              `_post_forward`, SHARD_GRAD_OP keeps it. No forward prefetch. The rate limiter
              (`limit_all_gathers`) only makes the CPU wait for the stream; it allocates nothing.
  backward    the root's pre-backward hook (on the loss) prefetches the last layer (`_prefetch_handle`,
              BACKWARD_PRE); each layer's pre-backward prefetches the one before it, so FULL_SHARD holds R and two
              layers while a layer's gradients are computed. A layer's views' gradients wait in
              `SplitWithSizesBackward`'s input until the last arrives, then are concatenated into the unsharded
              flat gradient (N elements); its post-backward hook frees the layer's unsharded parameters
              (`_post_backward_reshard`), then `_reduce_grad` reduce-scatters into the new shard.
  end         the root's flat gradient after the embedding's backward; its reduce-scatter; the optimizer step
              over the original parameters' views of the shards.
NO_SHARD walks the same moments as FULL_SHARD with its own terms (`flat_param.sharded`): whole flat parameters,
the `_mp_shard` in the gathered buffer's place (the root's freed after forward and made again by its pre-backward,
with no moment between), an in-place all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import partial

from llmem.components import Category, flat_adapters, flat_lora, flat_qlora, lora, no_sync, quant, returned_probs
from llmem.components import activations as act
from llmem.components import flat_param as fp
from llmem.components import logits as lg
from llmem.components.gradients import (
    embedding_gradient_accumulate_bytes,
    embedding_input_gradient_bytes,
    layer_gradient_bytes,
    tied_gradient_sum_bytes,
)
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import buffer_bytes
from llmem.plan import GradCkpt, Scheme, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.accumulation import gradients_kept
from llmem.walk.final_norm import norm_moment
from llmem.walk.fsdp import FsdpTerms, compute_plan, fsdp_terms
from llmem.walk.fsdp1_qlora import flat_qlora_moments, flat_qlora_terms
from llmem.walk.fsdp_layer import _backward_moments, _kept, _prebackward_moment
from llmem.walk.phase import Phase, moment, with_extra


def _gathered(w: Fsdp1Terms, layers: range | tuple[int, ...], adapters: range | None = None) -> int:
    """The root's unsharded flat parameter and those of the decoder layers `layers` (`_full_param_padded`);
    `--fsdp1-wrap adapters` under SHARD_GRAD_OP, which keeps the adapter units gathered too, those of the layers
    `adapters` (default: `layers`)."""
    unsharded = fp.unsharded_bytes(w.spec, w.flat)
    held = unsharded[0] + sum(unsharded[1 + layer] for layer in layers)
    if _zero2(w) and flat_adapters.wraps_adapters(w.flat):
        held += sum(flat_adapters.layers_unsharded_bytes(w.spec, w.flat)[layer]
                    for layer in (layers if adapters is None else adapters))
    return held


def _zero2(w: FsdpTerms) -> bool:
    return w.plan.scheme is Scheme.ZERO2


def forward_moments(w: FsdpTerms) -> list[Phase]:
    """The root's all-gather (input_ids alive), then layer 0's and the last layer's (activations grow linearly)
    with their transients (`flat_param.gather_transient_bytes`): SHARD_GRAD_OP keeps every earlier layer."""
    spec, cp, layers = w.spec, w.cp, w.layers
    phases = [moment("forward (root all-gather)", **w.persistent, activations=w.ids,
                     communication=_gathered(w, ()) + fp.gather_transient_bytes(spec, w.flat, 0))]
    embeds = 0  # the model's forward holds the embeddings' output through its layer loop (`fsdp.py`), extra where
    # no op of layer 0 saves it (LoRA: layer 0's input needs no grad)
    if w.plan.grad_ckpt is not GradCkpt.FULL and (w.first_saving or not act.saves_layer_input(spec, cp)):
        embeds = w.hidden
    for layer in sorted({0, layers - 1}):
        below = w.kept_layers(spec, cp, layer) + (embeds - w.first_saving if layer else 0)
        held = range(layer + 1) if _zero2(w) else (layer,)
        phases.append(moment(f"forward (layer {layer} all-gather)", **w.persistent,
                             activations=below + w.outer_act + w.hidden,
                             communication=_gathered(w, held, range(layer))
                             + fp.gather_transient_bytes(spec, w.flat, 1 + layer)))
    return phases


def head_moments(w: FsdpTerms) -> list[Phase]:
    """The end of forward, the loss, the root's pre-backward prefetch of the last layer (FULL_SHARD), the loss's and
    the lm_head's backward (the lm_head's view gradient waits in the root's `SplitWithSizesBackward`)."""
    spec, cp, layers = w.spec, w.cp, w.layers
    on = dict(**w.persistent, activations=w.forward_acts)
    every, last = range(layers), (layers - 1,)
    at_loss = _gathered(w, every if _zero2(w) else ())
    backward = _gathered(w, every if _zero2(w) else last)
    phases = [
        moment("forward (last layer)", **on, communication=backward),
        moment("loss forward", **on, logits=lg.loss_forward_peak_bytes(spec, cp), communication=at_loss),
    ]
    from llmem.walk.single import PROBS_MOMENT  # a checkpointed last layer's softmax beside the previous layer's
    probs = returned_probs.forward_extra_bytes(spec, cp, act.final_norm_bytes(spec, cp))  # returned probabilities
    if probs:
        phases.insert(1, moment(PROBS_MOMENT, **dict(on, activations=w.forward_acts + probs), communication=backward))
    if not _zero2(w):
        phases.append(moment(f"loss backward (prefetch of layer {layers - 1})", **on,
                             logits=lg.loss_backward_start_bytes(spec, cp),
                             communication=backward + fp.gather_transient_bytes(spec, w.flat, layers)))
    phases += [
        moment("loss backward", **on, logits=lg.loss_backward_peak_bytes(spec, cp), communication=backward),
        moment("lm_head backward", **on, gradients=w.root_grads_head, logits=lg.lm_head_backward_bytes(spec, cp),
               communication=backward),
    ]
    # the final norm's backward, the held logits alive (`walk.final_norm`; LoRA: the frozen norm of its own plan)
    return phases + norm_moment(spec, compute_plan(w.flat), w.persistent, w.forward_acts, w.root_grads_head,
                                w.logits, backward)


def layer_moments(w: FsdpTerms, layer: int, later: int) -> list[Phase]:
    """Layer `layer`'s backward: its pre-backward prefetch of layer - 1 (FULL_SHARD), the compute moments of the
    FSDP2 walk with FSDP1's gathered parameters, the flat gradient's concatenation, the reduce-scatter (the layer
    resharded first) and, under MixedPrecision, the cast of the new shard to the parameter dtype."""
    spec, plan = w.spec, w.flat
    below, own = _layer_kept(w, layer)
    gathered = _gathered(w, range(layer + 1) if _zero2(w) else range(max(0, layer - 1), layer + 1))
    phases = []
    if not _zero2(w) and layer:
        phases.append(_prebackward_moment(w, layer, later, 0, below, own,
                                          gathered + fp.gather_transient_bytes(spec, plan, layer)))
    phases += _lora_mlp_moments(w, layer, later, _backward_moments(w, layer, later, 0, {}, below, gathered))
    flat = fp.unsharded_grad_bytes(spec, plan, 1 + layer)
    # after layer 0's backward the RoPE cos / sin, saved only by the layers' RoPE muls, are released; under LoRA
    # with PEFT's input-require-grads hook the embeddings' output is a leaf its AccumulateGrad node keeps
    rope = 0 if layer else sum(s.bytes for s in act.outer_saved(spec, w.cp) if s.name.startswith("RoPE")) \
        - (w.hidden if lora.is_lora(plan) and flat_lora.layer0_input_requires_grad(plan) else 0)
    earlier = dict(**w.persistent, activations=below + w.outer_act - (w.first_saving if layer else rope),
                   logits=w.logits)
    # the gradient of the layer's input, unless it is layer 0's and needs none (LoRA: frozen embeddings)
    residual = 0 if not layer and lora.is_lora(plan) and not flat_lora.layer0_input_requires_grad(plan) \
        else w.residual_grad
    base = w.root_grads_head + later + residual
    views = layer_gradient_bytes(spec, w.cp, layer)  # the views' gradients, waiting in SplitWithSizesBackward
    views += lora.layer_adapter_bytes(spec, plan, layer, fp.gather_bytes(plan)) if lora.is_lora(plan) else 0
    views = flat_qlora.view_gradient_bytes(spec, plan, layer) if flat_qlora.applies(plan) else views
    phases.append(moment(f"backward (layer {layer}, flat gradient)", **earlier,
                         gradients=base + views + flat, communication=gathered))
    resharded = gathered - fp.unsharded_bytes(spec, plan)[1 + layer]
    phases.append(moment(f"reduce-scatter (layer {layer})", **earlier, gradients=base + flat,
                         communication=resharded + fp.reduce_scatter_bytes(spec, plan, 1 + layer)))
    cast = fp.cast_grad_bytes(spec, plan, 1 + layer)
    if cast:
        phases.append(moment(f"reduce-scatter (layer {layer}, gradient cast)", **earlier,
                             gradients=base + flat + cast, communication=resharded))
    return phases


def _lora_mlp_moments(w: Fsdp1Terms, layer: int, later: int, phases: list[Phase]) -> list[Phase]:
    """down_proj adapted (`flat_lora.down_proj_terms`): the layer's MLP moment of full fine-tuning (after the base
    down_proj's backward: the adapter branch's gradient of x, summed into the base's, takes the place of full
    fine-tuning's second intermediate-sized gradient) without the saves the adapter branch freed and with its
    gradients; before it, down_proj's lora_A backward, every save alive beside the layer output's gradient."""
    if not lora.is_lora(w.flat) or flat_qlora.applies(w.flat) or not flat_lora.adapts_down_proj(w.spec, w.flat):
        return phases
    saved, before, grads, inside = flat_lora.down_proj_terms(w.spec, w.flat, compute_plan(w.flat))
    name = f"backward (layer {layer})"
    mlp = next(ph for ph in phases if ph.name == name)
    at_lora_a = Phase(f"backward (layer {layer}, down_proj lora_A)", {
        **mlp.breakdown, Category.ACTIVATIONS: mlp.breakdown[Category.ACTIVATIONS] - before,
        Category.GRADIENTS: w.root_grads_head + later + w.residual_grad + grads + inside})
    mlp = with_extra(with_extra(mlp, name, Category.ACTIVATIONS, -saved), name, Category.GRADIENTS, grads)
    return [at_lora_a, mlp] + [ph for ph in phases if ph.name != name]


def end_moments(w: Fsdp1Terms) -> list[Phase]:
    """The embedding's backward (every layer's gradient sharded, the root gathered, its views' gradients waiting),
    the root's flat gradient, its reduce-scatter (the root resharded first) and cast, the optimizer step. A frozen
    root (LoRA, `flat_param.requires_grad`) has none of these: no gradient reaches the frozen embeddings."""
    spec, plan, cp = w.spec, w.flat, w.cp
    shards = fp.shard_bytes(spec, plan)
    layer_shards = sum(shards[1:])
    step = moment("optimizer step", **w.persistent, gradients=layer_shards if w.frozen_root else sum(shards),
                  logits=w.logits, temporaries=optimizer_step_temporary_bytes(spec, plan))
    on = dict(**w.persistent, logits=w.logits)
    if w.frozen_root:  # the last layer's gradient sharded, the root still gathered (freed in the final callback)
        return [moment("backward end", **on, gradients=layer_shards, communication=_gathered(w, ())), step]
    root_views = sum(p.numel for p in spec.outer_params) * cp.precision.param_bytes
    flat = fp.unsharded_grad_bytes(spec, plan, 0)
    phases = [
        moment("backward end", **on, gradients=layer_shards + root_views, communication=_gathered(w, ()),
               temporaries=embedding_gradient_accumulate_bytes(spec, cp) + embedding_input_gradient_bytes(spec, cp)),
        # tied, outside autocast: the engine's out-of-place sum of the shared view's two gradients (as on one GPU,
        # `tied_gradient_sum_bytes`), the embedding's input gradient freed
        *[moment("backward end, tied gradients summed", **on, gradients=layer_shards + root_views,
                 communication=_gathered(w, ()), temporaries=embedding_gradient_accumulate_bytes(spec, cp) + tied)
          for tied in (tied_gradient_sum_bytes(spec, cp),) if tied],
        moment("backward end (root flat gradient)", **on, gradients=layer_shards + root_views + flat,
               communication=_gathered(w, ())),
        moment("backward end (root reduce-scatter)", **on, gradients=layer_shards + flat,
               communication=fp.reduce_scatter_bytes(spec, plan, 0)),
    ]
    cast = fp.cast_grad_bytes(spec, plan, 0)
    if cast:
        phases.append(moment("backward end (root gradient cast)", **on, gradients=layer_shards + flat + cast))
    return phases + [step]


@dataclass(frozen=True)
class Fsdp1Terms(FsdpTerms):
    """The FSDP2 walk's terms of the program autograd runs (`plan`, `cp`) and the plan whose flat layout FSDP1
    builds (`flat`: LoRA's, with the adapters in the layers' units); `frozen_root`: the root requires no grad."""

    flat: TrainingPlan
    frozen_root: bool


def fsdp1_terms(spec: ModelSpec, plan: TrainingPlan) -> Fsdp1Terms:
    """The FSDP2 walk's compute terms with FSDP1's persistent bytes: the flat shards and the states over them.
    LoRA: the compute of full fine-tuning (every view of a layer's flat parameter requires grad, `flat_lora`) with
    the adapters' own saves, layer 0's input needing no grad, and the frozen root's final norm and lm_head."""
    qlora = flat_qlora.applies(plan)  # QLoRA: the 4-bit compute, the codes' views detached (`flat_qlora`)
    program = flat_lora.full_plan(plan) if lora.is_lora(plan) and not qlora else plan
    w = fsdp_terms(spec, program)
    cast = plan.precision.compute_bytes if plan.precision.is_mixed else None  # MixedPrecision(buffer_dtype=half)
    persistent = dict(parameters=sum(fp.shard_bytes(spec, plan)) + (quant.quant_state_bytes(spec, plan) if qlora
                                                                      else 0) + buffer_bytes(spec, plan, cast),
                      optimizer=optimizer_state_bytes(spec, plan))
    w = Fsdp1Terms(**{f.name: getattr(w, f.name) for f in fields(FsdpTerms)}, flat=plan,
                   frozen_root=not fp.requires_grad(spec, plan, 0))
    if not lora.is_lora(plan):
        return replace(w, persistent=persistent)
    if qlora:
        return flat_qlora_terms(w, persistent)
    cp, cp_full, layers = compute_plan(plan), w.cp, spec.num_layers
    first = flat_lora.first_layer_saving_bytes(spec, plan, cp_full)
    kept_layers = partial(flat_lora.kept_layers_bytes, plan=plan, cp=cp)
    current = partial(flat_lora.current_layer_backward_bytes, plan=plan, cp=cp)
    return replace(
        w, persistent=persistent, first_saving=first, kept_layers=lambda s, c, n: kept_layers(s, cp_full=c, count=n),
        current_layer=lambda s, c, n: current(s, cp_full=c, layer=n), root_grads_head=0,
        kept=w.kept + (0 if act.checkpoints_layers(plan) else flat_lora.adapter_saved_bytes(spec, plan, cp)),
        recompute=w.recompute + (flat_lora.adapter_saved_bytes(spec, plan, cp) if w.recompute else 0),
        forward_acts=w.forward_acts - first - flat_lora.final_norm_saving_bytes(spec, plan, cp, cp_full)
        + kept_layers(spec, cp_full=cp_full, count=layers) - act.kept_layers_bytes(spec, cp_full, layers))


def _layer_kept(w: Fsdp1Terms, layer: int) -> tuple[int, int]:
    """What the layers below `layer` keep and what it keeps itself (`fsdp_layer._kept`; LoRA: not memoised under
    the full plan's key, whose terms these are not)."""
    if w.flat is w.plan:
        return _kept(w, layer)
    k, cp = w.kept_layers, w.cp
    return (k(w.spec, cp, layer) - act.eager_mask_released_bytes(w.spec, cp, layer),
            k(w.spec, cp, layer + 1) - k(w.spec, cp, layer))


def fsdp1_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """FSDP1 (NO_SHARD, one GPU included, SHARD_GRAD_OP, FULL_SHARD): the candidate peak moments of one
    steady-state iteration on the largest rank; with gradients kept across micro-steps or steps, micro-step 2's."""
    from llmem.components.flat_adapters import wraps_adapters

    if wraps_adapters(plan):  # `--fsdp1-wrap adapters`: the recipes' wrap (`walk.fsdp1_adapters`)
        from llmem.walk.fsdp1_adapters import adapters_phases

        return adapters_phases(spec, plan)
    w = fsdp1_terms(spec, plan)
    phases = forward_moments(w) + head_moments(w)
    held = dict.fromkeys((ph.name for ph in phases), 0)  # phase -> the gradient shards micro-step 1 holds there
    shards = fp.shard_bytes(spec, plan)
    for layer in act.backward_layers(spec, w.cp, edge=2):
        later = sum(shards[2 + layer:])
        new = layer_moments(w, layer, later)
        held |= dict.fromkeys((ph.name for ph in new), later)
        phases += new
    phases += flat_qlora_moments(w, phases, held)
    end = end_moments(w)
    held |= dict.fromkeys((ph.name for ph in end[:-1]), sum(shards[1:]))
    if no_sync.applies(plan):  # --no-sync: the unsharded flat gradients kept until the last micro-step
        from llmem.walk.no_sync_fsdp1 import fsdp1_no_sync_phases

        phases += fsdp1_no_sync_phases(w, phases, end[:-1], held)
    elif gradients_kept(plan):
        phases += kept_gradient_moments(w, phases + end[:-1], held)
    return phases + end


def _in_post_backward_hook(name: str) -> int | None:
    """The unit whose post-backward hook a moment is inside (its reduction and cast), None outside one."""
    if name.startswith("reduce-scatter (layer "):
        return 1 + int(name.removeprefix("reduce-scatter (layer ").split(")")[0].split(",")[0])
    return 0 if name in ("backward end (root reduce-scatter)", "backward end (root gradient cast)") else None


def no_shard_hook_copy_bytes(w: Fsdp1Terms, name: str) -> int:
    """NO_SHARD under MixedPrecision with a gradient already in `.grad` (fp32, the parameter dtype): AccumulateGrad
    adds the new half flat gradient into it in place, and the autograd engine keeps that input alive through the
    node's post-hooks (torch 2.13 `torch/csrc/autograd/engine.cpp` `call_function`: `inputs` are passed to
    `call_post_hooks`), FSDP's `_post_backward_hook` among them, which casts the accumulated `.grad` to the reduce dtype
    (`fsdp/_runtime_utils.py:764`: a new N-element half copy) before the all-reduce: N · gb more than micro-step 1,
    where AccumulateGrad takes the new gradient as `.grad` itself. Sharded strategies: `.grad` is None by then."""
    unit = _in_post_backward_hook(name)
    if unit is None or fp.sharded(w.flat) or not fp.cast_grad_bytes(w.spec, w.flat, unit):
        return 0
    return fp.unsharded_grad_bytes(w.spec, w.flat, unit)


def kept_gradient_moments(w: Fsdp1Terms, phases: list[Phase], held: dict[str, int]) -> list[Phase]:
    """`--grad-accum K > 1` (every micro-step synced, no `no_sync`) or `--keep-grads`: a flat parameter's gradient
    shard of the previous micro-step (or the step's, zeroed in place) is its `.grad` until its unit's pre-backward,
    where `prepare_gradient_for_backward` moves it to `_saved_grad_shard` (torch 2.13 `fsdp/_flat_param.py:1627`),
    and `_accumulate_sharded_grad` adds the new reduce-scattered shard into it in place (`fsdp/_runtime_utils.py:906`):
    each moment of micro-step 2 is micro-step 1's with every unit's shard alive (those micro-step 1 held there,
    `held`, not twice). The shards are `flat_param.shard_bytes` (NO_SHARD: the whole flat gradient, accumulated by
    autograd's AccumulateGrad in place); a frozen root (LoRA) has none."""
    shards = fp.shard_bytes(w.spec, w.flat)
    total = sum(shards[1:]) if w.frozen_root else sum(shards)
    when = "micro-step 2" if w.plan.grad_accum > 1 else "gradients kept by zero_grad(set_to_none=False)"
    return [with_extra(ph, f"{ph.name}, gradient shards alive ({when})", Category.GRADIENTS,
                       total - held[ph.name] + no_shard_hook_copy_bytes(w, ph.name)) for ph in phases]
