"""One decoder layer's backward in the FSDP2 walk (`fsdp.py`), in order: ZeRO-3's pre-backward all-gather, the
layer's backward moment (and LoRA's recompute moments, falcon's math-path attention core), the reduce-scatter's
copy-in and the collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import activations as act
from llmem.components import attention_backward as ab
from llmem.components import attention_core as core
from llmem.components import communication as comm
from llmem.components import lora
from llmem.components import norm_backward as norm_bwd
from llmem.components import query_backward as qb
from llmem.components import rms_norm_backward as rms_bwd
from llmem.components.gradients import attention_backward_layer_gradient_bytes, layer_backward_peak_extra_bytes
from llmem.components.lora_recompute import recompute_moments
from llmem.plan import GradCkpt, Scheme, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.accumulation import gradients_kept
from llmem.walk.float8 import fsdp_float8_moments
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.fsdp import FsdpTerms


def lora_recompute_end(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> tuple[int, int] | None:
    """LoRA under FSDP2 with a MixedPrecisionPolicy (half adapters), `--grad-ckpt full`, lora_dropout > 0 and
    down_proj adapted: the end of a checkpointed layer's recompute, which measured above the layer's backward. The
    layer's backward first runs down_proj's `lora_B(...) * scaling` backward (a Python-float mul saves no tensor,
    so no recompute yet): the gradient of lora_B's output (tokens × h, half) beside the layer output's. The first
    saved tensor it needs then reruns the layer's forward under `fork_rng` (which stashes the current CPU generator
    state, `checkpoint_rng_state_bytes`) up to down_proj's lora_A, the last saved tensor, and stops. There every
    saved tensor but the scaling lora_B's mul saves is recomputed, beside the forward's intermediates no op saves:
    the attention residual, the MLP input and down_proj's base output (tokens × h each) and down_proj's input
    `act_fn(gate) * up` (tokens × intermediate). Not counted: the bf16 matmul's scratch inside lora_A (CPU kernel,
    25.6 KB on the test llama). Returns (activations beyond the recomputed layer's `recompute_bytes`, gradients
    beyond the layer output's), or None where this moment is not modelled (measured only in this configuration; with
    dropout 0 the layer's backward peaks). Traced LoRA (`spec.derived`): None, its layer backward's window is traced on
    the checkpointed program, recompute included (`llmem.derive.lora.checkpointed_extra_bytes`)."""
    if spec.derived is not None:
        return None
    if not (lora.half_adapters(plan) and plan.grad_ckpt is GradCkpt.FULL and plan.lora_dropout > 0):
        return None
    if not any("down_proj" in p.name for p in lora.targeted(spec, plan)):
        return None
    rb, tokens = cp.precision.compute_bytes, plan.batch_size * plan.seq_len
    scaling = sum(s.bytes for s in lora.layer_saved(spec, cp, half=True) if s.name.startswith("down_proj: scaling"))
    intermediates = tokens * (3 * spec.hidden_size + spec.intermediate_size) * rb
    live = intermediates + act.checkpoint_rng_state_bytes(cp) - scaling
    return live, tokens * spec.hidden_size * rb



def _kept(w: FsdpTerms, layer: int) -> tuple[int, int]:
    """What the layers below `layer` keep, less the eager masks only the layers above it took
    (`activations.eager_mask_released_bytes`), and what the layer itself keeps; once per plan and layer."""
    spec, cp, kept_layers = w.spec, w.cp, w.kept_layers
    return spec.memo(("fsdp.kept", w.plan.key, layer), lambda: (
        kept_layers(spec, cp, layer) - act.eager_mask_released_bytes(spec, cp, layer),
        kept_layers(spec, cp, layer + 1) - kept_layers(spec, cp, layer)), per_plan=True)


def _backward_terms(w: FsdpTerms, layer: int) -> tuple[int, int, int]:
    """Of the layer's table (`activations.layer_plan`), the MLP-output dropout's and gemma2's post-MLP norm's saves
    (released by the MLP's backward moment), and that moment's gradients beyond the saved tensors; once per plan and
    layer."""
    def compute() -> tuple[int, int, int]:
        lp, ls = act.layer_plan(w.cp, layer), act.layer_spec(w.spec, w.cp, layer)  # of the layer's kind
        return (act.mlp_output_dropout_bytes(ls, lp), norm_bwd.post_mlp_norm_released_bytes(ls, lp),
                layer_backward_peak_extra_bytes(ls, lp, w.adapter_grad))
    return w.spec.memo(("fsdp.backward", w.plan.key, layer), compute, per_plan=True)


def _gathers(w: FsdpTerms, layer: int) -> tuple[int, int, int]:
    """The unsharded parameters at the layer's pre-backward, backward and reduce-scatter (`communication`); once per
    plan layout and layer."""
    spec, plan = w.spec, w.plan
    return spec.memo(("fsdp.gathers", plan.layout_key, layer), lambda: (
        comm.pre_backward_gather_bytes(spec, plan, layer), comm.backward_gather_bytes(spec, plan, layer),
        comm.backward_gather_bytes(spec, plan, layer, own=False)))


def _current(w: FsdpTerms, layer: int) -> int:
    """What layer `layer` holds while its own backward runs (`activations.current_layer_backward_bytes`; with
    uniform layers and every layer checkpointed or none, the one per-plan value)."""
    if w.partial or w.varied or lora.is_lora(w.plan):
        return w.current_layer(w.spec, w.cp, layer)
    return w.recompute or w.kept


def _prebackward_moment(w: FsdpTerms, layer: int, later: int, retained: int, below: int, own: int,
                        gathered: int) -> Phase:
    """ZeRO-3 (and TP x FSDP2) all-gather again in backward. The layer's pre-backward
    (`FSDPParamGroup.pre_backward`): its saved tensors and the gradient of its output alive, its copy-out (new
    unsharded storage beside its prefetched all-gather output, freed next), then the prefetch of layer - 1
    (`_backward_prefetch`): a new all-gather output while the unsharded parameters stay, and on CPU gloo's flat
    output inside the all-gather."""
    return moment(
        f"backward (layer {layer}, pre-backward all-gather)", **w.persistent,
        activations=below + w.outer_act + own - w.first_saving,
        gradients=w.root_grads_head + later + w.residual_grad,
        logits=w.logits, communication=gathered + retained)


def _backward_moments(w: FsdpTerms, layer: int, later: int, retained: int, held: dict[str, int],
                      below: int, gathered: int) -> list[Phase]:
    """The layer's backward moment (the MLP's), LoRA's end of recompute (`lora_recompute_end`) and recompute moments
    (fp32 adapters), falcon's math-path attention core. Of the layer's kind (`activations.layer_spec`)."""
    spec, cp = w.spec, w.cp
    current = _current(w, layer)
    mlp_dropout, post_norm, peak_extra = _backward_terms(w, layer)  # the saves freed by the MLP's backward
    on = dict(**w.persistent, logits=w.logits, communication=gathered + retained)
    phases = [moment(f"backward (layer {layer})", **on,
                     activations=below + w.outer_act + current - w.first_saving - mlp_dropout - post_norm,
                     gradients=w.root_grads_head + later + peak_extra)]
    for norm in (rms_bwd.PRE_MLP, rms_bwd.INPUT):
        phases += _norm_moment(w, layer, later, on, held, below + w.outer_act + current - mlp_dropout, norm)
    phases += fsdp_float8_moments(w, layer, later, below + w.outer_act + current - w.first_saving - mlp_dropout,
                                  gathered + retained)
    phases += _attention_moments(w, layer, later, on, held, below + w.outer_act + current)
    if w.recompute_end is not None:  # see `lora_recompute_end`
        live, grads = w.recompute_end
        phases.append(moment(f"backward (layer {layer}, end of its recompute)", **on,
                             activations=below + w.outer_act + current - (w.first_saving if layer == 0 else 0) + live,
                             gradients=w.root_grads_head + later + w.residual_grad + grads))
        held[phases[-1].name] = later
    if w.lora and not w.half and not w.partial:  # fp32 adapters: the single-GPU recompute moments
        for what, (fwd, grads) in recompute_moments(spec, cp).items():
            phases.append(moment(f"backward (layer {layer}, {what})", **on,
                                 activations=below + w.outer_act + current + sum(s.bytes for s in fwd),
                                 gradients=w.root_grads_head + later + w.residual_grad + sum(s.bytes for s in grads)))
            held[phases[-1].name] = later
    if w.falcon_math:
        phases.append(moment(
            f"backward (layer {layer}, attention core)", **on,
            activations=below + w.outer_act + current - mlp_dropout - act.attention_backward_freed_bytes(spec, cp),
            gradients=w.root_grads_head + later + attention_backward_layer_gradient_bytes(spec, cp),
            temporaries=act.attention_backward_transient_bytes(spec, cp)))
    return phases


def _norm_moment(w: FsdpTerms, layer: int, later: int, on: dict, held: dict[str, int], alive: int,
                 norm: str) -> list[Phase]:
    """A norm's backward (`rms_norm_backward`): the saved tensors of the nodes after it released, their unsharded
    weight gradients and the residual stream's gradient beside the norm's traced backward; `alive`: the layers' kept
    bytes, the layer's own and the outer (less the MLP output's dropout)."""
    spec, cp = w.spec, w.cp
    if w.lora and rms_bwd.applies_lora(spec, cp, layer):  # frozen norms: the adapters' gradients, the LoRA table
        saved, grads = lora.layer_saved(spec, act.layer_plan(cp, layer), half=w.half), w.adapter_grad
        released = rms_bwd.lora_released_bytes(saved, norm)
        weight = rms_bwd.lora_gradient_bytes(spec, cp, norm, grads)
    elif rms_bwd.applies(spec, cp):
        released = rms_bwd.released_bytes(tuple(act.layer_saved(spec, act.layer_plan(cp, layer))), norm)
        weight = rms_bwd.weight_gradient_bytes(spec, cp, norm)
    else:
        return []
    what = "pre-MLP norm" if norm == rms_bwd.PRE_MLP else "input norm"
    phases = [moment(f"backward (layer {layer}, {what})", **on, activations=alive - w.first_saving - released,
                     gradients=w.root_grads_head + later + w.residual_grad + weight
                     + rms_bwd.backward_bytes(spec, cp))]
    held |= {ph.name: later for ph in phases}
    return phases


def _attention_moments(w: FsdpTerms, layer: int, later: int, on: dict, held: dict[str, int],
                       alive: int) -> list[Phase]:
    """gemma2's post-feedforward norm backward (`norm_backward`) and the eager attention core's softmax backward
    (`attention_core`), as in the single-device walk on the compute plan (unsharded gradients in param_dtype;
    LoRA: the adapters' in `adapter_grad` bytes); `alive`: the layers' kept bytes, the layer's own and the outer."""
    spec, cp = w.spec, w.cp
    phases = []
    if w.post_norm:
        phases.append(moment(f"backward (layer {layer}, post-feedforward norm)", **on,
                             activations=alive - w.first_saving,
                             gradients=w.root_grads_head + later + w.residual_grad + w.post_norm_bwd))
        held[phases[-1].name] = later
    if w.core:
        released, transient = core.layer_core_terms(spec, act.layer_plan(cp, layer), w.half)
        phases.append(moment(f"backward (layer {layer}, attention core)", **on,
                             activations=alive - w.first_saving - released,
                             gradients=w.root_grads_head + later + w.core_grads + transient))
    return phases + _query_moments(w, layer, later, on, held, alive) + _layernorm_moments(w, layer, later, on, held,
                                                                                         alive) \
        + _traced_sdpa_moment(w, layer, later, on, held, alive)


def _traced_sdpa_moment(w: FsdpTerms, layer: int, later: int, on: dict, held: dict[str, int],
                        alive: int) -> list[Phase]:
    """A traced layer's backward when sdpa's backward kernel has returned (`derive.context_parallel.
    sdpa_backward_extra_bytes`): the layer's backward moment with its window's live bytes at that event instead of
    their peak (so never above it); the moment context parallelism's ring extends (`walk.context_parallel`)."""
    from llmem.derive.context_parallel import sdpa_backward_extra_bytes

    if w.spec.derived is None:
        return []
    extra = sdpa_backward_extra_bytes(act.layer_spec(w.spec, w.cp, layer), act.layer_plan(w.cp, layer))
    if extra is None:
        return []
    mlp_dropout, post_norm, _ = _backward_terms(w, layer)
    phase = moment(f"backward (layer {layer}, sdpa backward)", **on,
                   activations=alive - w.first_saving - mlp_dropout - post_norm,
                   gradients=w.root_grads_head + later + extra)
    held[phase.name] = later
    return [phase]


def _layernorm_moments(w: FsdpTerms, layer: int, later: int, on: dict, held: dict[str, int],
                       alive: int) -> list[Phase]:
    """The LayerNorm decoders' fused sdpa backward and dropped probabilities' bmm backward
    (`attention_backward`), on the compute plan (unsharded gradients); `alive` as in `_attention_moments`."""
    spec, plan, cp = w.spec, w.plan, w.cp
    lp = act.layer_plan(cp, layer)
    items = tuple(act.layer_saved(spec, lp))
    phases = [moment(f"backward (layer {layer}, {what})", **on, activations=alive - w.first_saving - released,
                     gradients=w.root_grads_head + later + w.core_grads + transient)
              for what, released, transient in ab.moments(spec, plan, lp, items)]
    held |= {ph.name: later for ph in phases}
    return phases


def _query_moments(w: FsdpTerms, layer: int, later: int, on: dict, held: dict[str, int], alive: int) -> list[Phase]:
    """sdpa's, q's RoPE and q_norm's backward (`query_backward`), on the compute plan (unsharded gradients);
    `alive` as in `_attention_moments`."""
    spec, plan, cp = w.spec, w.plan, w.cp
    if qb.applies_lora_sdpa(spec, plan) or qb.applies_moe_sdpa(spec, plan):
        return _lora_sdpa_moment(w, layer, later, on, held, alive)
    if not qb.applies_rope(spec, plan):
        return []
    acts = alive - w.first_saving
    lp = act.layer_plan(cp, layer)
    saved = act.layer_saved(spec, lp)
    after_core = core.eager_core_layer_gradient_bytes(spec, cp)
    phases = [moment(f"backward (layer {layer}, q RoPE backward)", **on, activations=acts - qb.rope_released(saved),
                     gradients=w.root_grads_head + later + after_core + qb.rope_transient_bytes(spec, lp))]
    if qb.applies_sdpa(spec, plan):
        phases.insert(0, moment(f"backward (layer {layer}, sdpa backward)", **on,
                                activations=acts - qb.sdpa_released(saved),
                                gradients=w.root_grads_head + later + after_core + qb.sdpa_transient_bytes(spec, lp)))
    if qb.applies_q_norm(spec, plan):
        phases.append(moment(f"backward (layer {layer}, q_norm backward)", **on,
                             activations=acts - qb.q_norm_released(saved),
                             gradients=w.root_grads_head + later + qb.q_norm_layer_gradient_bytes(spec, cp)
                             + qb.q_norm_transient_bytes(spec, lp)))
    held |= {ph.name: later for ph in phases}
    return phases


def _lora_sdpa_moment(w: FsdpTerms, layer: int, later: int, on: dict, held: dict[str, int],
                      alive: int) -> list[Phase]:
    """LoRA's sdpa backward (`query_backward.applies_lora_sdpa`): the layer's LoRA table (`lora.layer_saved`, half
    adapters under a MixedPrecisionPolicy) less what the ops after sdpa saved (`lora_sdpa_released`), the adapters'
    unsharded gradients of the Linears after the core (`core_grads`), and sdpa's output gradient, q's, k's and v's
    and the residual stream's (`sdpa_transient_bytes`) on the compute plan; `alive` as in `_attention_moments`. The
    MoE families' in full fine-tuning (`applies_moe_sdpa`), on their layer's table, the MoE block's gradients
    made."""
    spec, cp = w.spec, w.cp
    lp = act.layer_plan(cp, layer)
    if w.lora:
        released = qb.lora_sdpa_released(lora.layer_saved(spec, lp, half=w.half))
    else:
        released = qb.sdpa_released(tuple(act.layer_saved(spec, lp)))
    phase = moment(f"backward (layer {layer}, sdpa backward)", **on,
                   activations=alive - w.first_saving - released,
                   gradients=w.root_grads_head + later + w.core_grads + qb.sdpa_transient_bytes(spec, lp))
    held[phase.name] = later
    return [phase]


def _reduce_moments(w: FsdpTerms, layer: int, later: int, below: int, gathered: int) -> list[Phase]:
    """`foreach_reduce`: the copy-in of the layer's unsharded gradients into its reduce_scatter_input, then the
    collective (unsharded gradients freed, the output shard and gloo's copy allocated); each of the layer's size."""
    earlier = dict(**w.persistent, activations=below + w.outer_act - (w.first_saving if layer else 0), logits=w.logits)
    gather, rs_in = gathered + w.reduce_extras[layer], w.rs_ins[layer]
    return [
        moment(f"reduce-scatter copy-in (layer {layer})", **earlier,
               gradients=w.root_grads_head + later + w.layer_grads[layer],
               communication=gather + rs_in + w.copy_in_extras[layer]),
        moment(f"reduce-scatter (layer {layer})", **earlier,
               gradients=w.root_grads_head + later + w.sharded_layer[layer],
               communication=gather + rs_in + w.rs_scratches[layer]),
    ]


def fsdp_layer_moments(w: FsdpTerms, layer: int, held: dict[str, int]) -> list[Phase]:
    """Layer `layer`'s backward moments; `held` gets the sharded gradients micro-step 1 holds at each (the later
    layers', for --grad-accum: `accumulation.fsdp_accumulation_phases`)."""
    later = w.sharded_later[layer] * w.resident
    if gradients_kept(w.plan):  # `held` is read by the accumulation phases only
        held |= {f"{what} (layer {layer}{where})": later for where in ("", ", attention core")
                 for what in ("backward", "reduce-scatter copy-in", "reduce-scatter")}
    retained = w.rs_ins[layer + 1] if layer < w.layers - 1 else 0  # the previous layer's reduce_scatter_input
    phases, (below, own), (pre, during, after) = [], _kept(w, layer), _gathers(w, layer)
    if w.plan.scheme is not Scheme.ZERO2:
        phases.append(_prebackward_moment(w, layer, later, retained, below, own, pre))
        held[phases[-1].name] = later
    phases += _backward_moments(w, layer, later, retained, held, below, during)
    return phases + _reduce_moments(w, layer, later, below, after)
