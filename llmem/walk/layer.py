"""One decoder layer's backward in the walk of one device, DDP, ZeRO-1 and TP (`single.py`): its moments in order —
the MLP's (`gradients.layer_backward_peak_extra_bytes`), gemma2's post-feedforward norm (`norm_backward`), a
checkpointed LoRA layer's recompute (`lora.recompute_moments`), the eager attention core (`attention_core`) or
falcon's math-path core (`layer_tables.attention_backward_*`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import activations as act
from llmem.components import attention_core as core
from llmem.components import autocast, grad_accum, lora, quant
from llmem.components import communication as comm
from llmem.components import norm_backward as norm_bwd
from llmem.components import quant_int8_traced as int8_traced
from llmem.components import query_backward as qb
from llmem.components import step_in_backward as sib
from llmem.components import weight_gradient as wgrad
from llmem.components.gradients import (
    attention_backward_layer_gradient_bytes,
    later_layers_gradient_bytes,
    layer_backward_held_gradient_bytes,
    layer_backward_peak_extra_bytes,
    layer_output_gradient_bytes,
)
from llmem.components.lora_recompute import recompute_moments
from llmem.walk.attention_backward import attention_copies, attention_moments
from llmem.walk.phase import Category, Phase, moment

if TYPE_CHECKING:
    from llmem.walk.single import Terms


def held_bytes(t: Terms, layer: int) -> int:
    """What the decoder layers hold while layer `layer` runs backward: the layers below it their kept activations,
    it its saved tensors (checkpointed: its recompute's); --quant int8: the 8-bit Linears' inputs of the layers whose
    backward ran (and, checkpointed, of the one recomputing). Less the eager masks only the layers above took.
    Layers of several kinds (`varied`): each layer's own."""
    spec, plan = t.spec, t.plan
    if t.partial or t.varied or lora.is_lora(plan) or plan.activation_offload:  # (LoRA: layer 0's recompute keeps
        # what its no-grad input lets it; --activation-offload: the layers below hold nothing)
        held = t.kept_layers(spec, plan, layer) + t.current_layer(spec, plan, layer)
    else:
        held = layer * t.kept + (t.recompute or t.kept)
    recomputing = bool(t.recompute) and (not t.partial or plan.checkpointed(layer))  # (--ckpt-every K: some layers)
    held += (t.layers - 1 - layer + recomputing) * t.held_layer \
        + quant.held_past_adapter_bytes(spec, plan, recomputing if t.partial else None) \
        + int8_traced.during_backward_bytes(spec, plan, layer)
    return held - act.eager_mask_released_bytes(spec, plan, layer)  # a mask only layers above took is gone


def _mlp_moment(t: Terms, layer: int, name: str, held: int, later: int) -> Phase:
    """The MLP's backward moment; the MLP-output dropout's saved tensor and gemma2's post-feedforward norm's are
    released by then, and the last MLP Linear's half weight copy with its MmBackward0. Of the layer's kind."""
    spec, plan = t.spec, t.plan
    lp, ls = act.layer_plan(plan, layer), act.layer_spec(spec, plan, layer)
    post_norm = norm_bwd.post_mlp_norm_released_bytes(ls, lp)
    return moment(
        name, **t.persistent,
        activations=held + t.outer_act - act.mlp_output_dropout_bytes(ls, lp) - post_norm,
        gradients=t.grads_outer + later + layer_backward_peak_extra_bytes(ls, lp),
        temporaries=t.copies_below(layer) + t.copies[layer] - autocast.released_by_mlp_backward_bytes(spec, lp),
        logits=t.logits, communication=t.gathered(layer + 1) + comm.backward_transient_bytes(spec, plan))


def _weight_gradient_moments(t: Terms, layer: int, name: str, mlp: Phase, later: int) -> list[Phase]:
    """`--ddp-bucket-view`: the last MLP Linear's weight gradient made, and under autocast its fp32 cast, before it
    goes into its bucket (`weight_gradient`); as the MLP moment (`mlp`) otherwise, the Linear's half copy still
    saved at the first."""
    spec, plan = t.spec, t.plan
    b = dict(mlp.breakdown)
    own = b[Category.GRADIENTS] - t.grads_outer - later
    made = dict(b, **{Category.GRADIENTS: b[Category.GRADIENTS] - own + wgrad.made_gradient_bytes(spec, plan),
                      Category.TEMPORARIES: b[Category.TEMPORARIES]
                      + autocast.released_by_mlp_backward_bytes(spec, act.layer_plan(plan, layer))})
    phases = [Phase(f"{name[:-1]}, MLP weight gradient)", made)]
    if autocast.applies(plan):
        cast = dict(b, **{Category.GRADIENTS: b[Category.GRADIENTS] - own + wgrad.cast_gradient_bytes(spec, plan),
                          Category.ACTIVATIONS: b[Category.ACTIVATIONS] - wgrad.cast_released_bytes(spec, plan)})
        phases.append(Phase(f"{name[:-1]}, MLP weight gradient cast to fp32)", cast))
    return phases


def _step_moment(t: Terms, name: str, mlp: Phase, later: int) -> Phase:
    """`--optimizer-in-backward`: the last MLP Linear's hook steps it (the layer's largest tensor's step,
    `step_in_backward.layer_step_bytes`) once its MmBackward0 (under autocast the cast) returned — its saved input
    released, the weight gradient in the parameter dtype beside the input and layer output gradients
    (`weight_gradient.stepped_gradient_bytes`). A grouped-experts MoE layer: its moment with the step of the expert
    tensor it makes (`step_in_backward.moe_step_moment_bytes`). Elsewhere (traced): the MLP moment with the step on
    top. Not LoRA: an adapter's step (2 · r · max(in, out) · 4 bytes at most) runs right after its lora_B / lora_A
    MmBackward0, before the frozen Linear's backward makes the MLP moment's intermediate gradients, and under
    checkpointing after the recompute's transients are gone (measured: the checkpointed gemma2 and gpt2 LoRA layers
    peak in the recompute, 3-4% above their adapters' steps)."""
    step = sib.layer_step_bytes(t.spec, t.plan)
    b = dict(mlp.breakdown)
    if sib.moe_applies(t.spec, t.plan):  # the step of the expert tensor each moment makes
        grads, step = sib.moe_step_moment_bytes(t.spec, t.plan)
        b[Category.GRADIENTS] = t.grads_outer + later + grads
    b[Category.TEMPORARIES] += step
    if wgrad.applies(t.spec, t.plan):
        b[Category.GRADIENTS] = t.grads_outer + later + wgrad.stepped_gradient_bytes(t.spec, t.plan)
        b[Category.ACTIVATIONS] -= wgrad.cast_released_bytes(t.spec, t.plan)
    return Phase(f"{name[:-1]}, step in backward)", b)


def _post_norm_moment(t: Terms, layer: int, name: str, held: int, later: int) -> Phase:
    """gemma2: the post-feedforward norm runs backward first, every saved tensor of the layer alive."""
    return moment(
        f"{name[:-1]}, post-feedforward norm)", **t.persistent, activations=held + t.outer_act,
        gradients=t.grads_outer + later + layer_output_gradient_bytes(t.spec, t.plan)
        + norm_bwd.post_mlp_norm_backward_bytes(t.spec, t.plan),
        temporaries=t.copies_below(layer) + t.copies[layer],
        logits=t.logits, communication=t.gathered(layer + 1) + comm.backward_transient_bytes(t.spec, t.plan))


def _recompute_moments(t: Terms, layer: int, name: str, held: int, later: int) -> list[Phase]:
    """A checkpointed LoRA layer during the recompute of its forward (`lora.recompute_moments`)."""
    spec, plan = t.spec, t.plan
    moments = recompute_moments(spec, plan) if plan.checkpointed(layer) else {}
    return [moment(
        f"{name[:-1]}, {what})", **t.persistent, activations=held + t.outer_act + sum(s.bytes for s in fwd),
        gradients=t.grads_outer + later + layer_output_gradient_bytes(spec, plan) + sum(s.bytes for s in grads),
        temporaries=t.copies_below(layer) + t.copies[layer],
        logits=t.logits, communication=t.gathered(layer + 1)) for what, (fwd, grads) in moments.items()]


def _core_moment(t: Terms, layer: int, name: str, held: int, later: int) -> Phase:
    """The eager attention core's softmax backward (`attention_core`), on the layer's (LoRA) table."""
    spec, plan = t.spec, t.plan
    released, transient = core.layer_core_terms(spec, act.layer_plan(plan, layer))
    return moment(
        f"{name[:-1]}, attention core)", **t.persistent,
        activations=held + t.outer_act - released,
        gradients=t.grads_outer + later + core.eager_core_layer_gradient_bytes(spec, plan) + transient,
        temporaries=attention_copies(t, layer, core.eager_core_weight_copy_bytes(spec, plan)),
        logits=t.logits, communication=t.gathered(layer + 1))


def _bloom_recompute_moment(t: Terms, layer: int, name: str, held: int, later: int) -> Phase:
    """A checkpointed bloom layer's recompute at its attention's residual add (`attention_core.recompute_locals_*`):
    the layer output's gradient and, under autocast, its half cast for the last MLP Linear (the trigger), the
    recompute's RNG state copy on the cpu profile."""
    from llmem.components.activations import CPU_RNG_STATE_BYTES
    from llmem.plan import Device

    spec, plan = t.spec, t.plan
    lp = act.layer_plan(plan, layer)
    mlp = core.recompute_mlp_saved_bytes(spec, lp, tuple(act.layer_saved(spec, lp)))
    tokens_h = plan.batch_size * plan.seq_len * spec.hidden_size
    trigger_cast = tokens_h * plan.precision.compute_bytes if autocast.applies(plan) else 0
    rng = CPU_RNG_STATE_BYTES if plan.device is Device.CPU else 0
    return moment(
        f"{name[:-1]}, recompute at the attention's residual add)", **t.persistent,
        activations=held + t.outer_act - mlp + core.recompute_locals_bytes(spec, lp),
        gradients=t.grads_outer + later + layer_output_gradient_bytes(spec, plan) + trigger_cast,
        temporaries=core.recompute_weight_copy_bytes(spec, plan) + rng,
        logits=t.logits, communication=t.gathered(layer + 1))


def _falcon_recompute_moment(t: Terms, layer: int, name: str, held: int, later: int) -> Phase:
    """A checkpointed falcon layer's recompute at its eager softmax (`attention_core.falcon_recompute_*`): the saved
    tensors made after it not yet (under autocast neither dense_h_to_4h's half input), its locals, the layer
    output's gradient, the qkv Linear's half weight copy its matmul saves, the recompute's RNG state copy (cpu)."""
    from llmem.components.activations import CPU_RNG_STATE_BYTES
    from llmem.plan import Device

    spec, plan = t.spec, t.plan
    lp = act.layer_plan(plan, layer)
    tokens_h = plan.batch_size * plan.seq_len * spec.hidden_size
    later_saved = core.falcon_recompute_later_bytes(tuple(act.layer_saved(spec, lp))) \
        + plan.precision.is_mixed * tokens_h * plan.precision.compute_bytes
    return moment(
        f"{name[:-1]}, recompute at the softmax)", **t.persistent,
        activations=held + t.outer_act - later_saved + core.falcon_recompute_locals_bytes(spec, lp),
        gradients=t.grads_outer + later + layer_output_gradient_bytes(spec, plan),
        temporaries=core.eager_core_weight_copy_bytes(spec, plan) + CPU_RNG_STATE_BYTES * (plan.device is Device.CPU),
        logits=t.logits, communication=t.gathered(layer + 1))


def _query_moments(t: Terms, layer: int, name: str, held: int, later: int) -> list[Phase]:
    """sdpa's backward, q's RoPE backward and q_norm's (`query_backward`), on the layer's table."""
    spec, plan = t.spec, t.plan
    lp = act.layer_plan(plan, layer)
    saved = act.layer_saved(spec, lp)
    on = dict(**t.persistent, logits=t.logits, communication=t.gathered(layer + 1))
    after_core = core.eager_core_layer_gradient_bytes(spec, plan)
    copies = attention_copies(t, layer, core.eager_core_weight_copy_bytes(spec, plan))
    phases = [moment(f"{name[:-1]}, q RoPE backward)", **on, activations=held + t.outer_act - qb.rope_released(saved),
                     gradients=t.grads_outer + later + after_core + qb.rope_transient_bytes(spec, lp),
                     temporaries=copies)]
    if qb.applies_sdpa(spec, plan):
        phases.insert(0, moment(f"{name[:-1]}, sdpa backward)", **on,
                                activations=held + t.outer_act - qb.sdpa_released(saved),
                                gradients=t.grads_outer + later + after_core + qb.sdpa_transient_bytes(spec, lp),
                                temporaries=copies))
    if qb.applies_q_norm(spec, plan):
        phases.append(moment(f"{name[:-1]}, q_norm backward)", **on,
                             activations=held + t.outer_act - qb.q_norm_released(saved),
                             gradients=t.grads_outer + later + qb.q_norm_layer_gradient_bytes(spec, plan)
                             + qb.q_norm_transient_bytes(spec, lp),
                             temporaries=attention_copies(t, layer, qb.q_norm_weight_copy_bytes(spec, plan))))
    return phases


def _falcon_math_moment(t: Terms, layer: int, name: str, held: int, later: int) -> Phase:
    """Falcon's math-path (sdpa) attention core's softmax backward."""
    spec, plan = t.spec, t.plan
    mlp_dropout = act.mlp_output_dropout_bytes(spec, act.layer_plan(plan, layer))
    return moment(
        f"{name[:-1]}, attention core)", **t.persistent,
        activations=held + t.outer_act - mlp_dropout - act.attention_backward_freed_bytes(spec, plan),
        gradients=t.grads_outer + later + attention_backward_layer_gradient_bytes(spec, plan),
        temporaries=t.copies_below(layer)
        + autocast.attention_backward_weight_copy_bytes(spec, plan)
        + act.attention_backward_transient_bytes(spec, plan),
        logits=t.logits, communication=t.gathered(layer + 1))


def layer_moments(t: Terms, layer: int, name: str, backward_later: dict[str, int],
                  mlp_held: dict[str, int] | None = None) -> list[Phase]:
    """Layer `layer`'s backward moments, named after `name`; `backward_later` gets the later layers' gradients at
    each moment whose gradients --grad-accum's micro-step 2 tells apart (`accumulation.accumulation_phases`), and
    `mlp_held` the layer's own weight gradients its MLP moment holds as `.grad`s
    (`gradients.layer_backward_held_gradient_bytes`)."""
    spec, plan = t.spec, t.plan
    later = backward_later[name] = later_layers_gradient_bytes(spec, plan, layer)
    if mlp_held is not None:
        lp = act.layer_plan(plan, layer)  # + the last MLP Linear's new weight gradient's own span (grad_accum)
        mlp_held[name] = layer_backward_held_gradient_bytes(spec, lp) + grad_accum.mlp_weight_gradient_released_bytes(
            spec, lp)
    held = held_bytes(t, layer)
    phases = [_mlp_moment(t, layer, name, held, later)]
    if wgrad.applies(spec, plan):
        phases += _weight_gradient_moments(t, layer, name, phases[0], later)
    if sib.layer_step_bytes(spec, plan) and not lora.is_lora(plan):  # (SGD, fused: no step temporaries)
        phases.append(_step_moment(t, name, phases[0], later))
    if norm_bwd.applies(spec) and not lora.is_lora(plan):
        phases.append(_post_norm_moment(t, layer, name, held, later))
    phases += _recompute_moments(t, layer, name, held, later)
    if core.applies(spec, plan):
        phases.append(_core_moment(t, layer, name, held, later))
    if core.recompute_locals_applies(spec, plan) and plan.checkpointed(layer):
        phases.append(_bloom_recompute_moment(t, layer, name, held, later))
    if core.falcon_recompute_applies(spec, plan) and plan.checkpointed(layer):
        phases.append(_falcon_recompute_moment(t, layer, name, held, later))
    if qb.applies_rope(spec, plan):
        for ph in _query_moments(t, layer, name, held, later):
            phases.append(ph)
            own = qb.q_norm_layer_gradient_bytes if "q_norm" in ph.name else core.eager_core_layer_gradient_bytes
            backward_later[ph.name] = later + own(spec, plan)  # (micro-step 2: the layer's `.grad`s made before)
    if act.falcon_math_attention(spec, plan) and not lora.is_lora(plan):
        phases.append(_falcon_math_moment(t, layer, name, held, later))
    for ph in attention_moments(t, layer, name, held, later):  # the LayerNorm decoders' sdpa / probabilities' bmm
        phases.append(ph)
        backward_later[ph.name] = later + core.eager_core_layer_gradient_bytes(spec, plan)  # (micro-step 2)
    # micro-step 2 (`accumulation.accumulation_phases`): the later layers' `.grad`s at each moment; the attention
    # core's are derived there from the MLP moment's
    for ph in phases:
        if not ph.name.endswith(", attention core)"):
            backward_later.setdefault(ph.name, later)
    return phases
