"""The walk of one device, DDP, ZeRO-1 and TP: the forward's end, the loss and lm_head, each evaluated decoder layer's
backward moments (`layer_moments`), the end of backward and the optimizer step, in that order (the first of equal
peaks names the peak). The per-plan terms every moment reads are computed once (`terms`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from llmem.components import (
    Category,
    act_offload,
    autocast,
    chunked_ce,
    decoder_locals,
    fused_ce,
    lora,
    lora_forward,
    lora_head,
    moe_forward,
    quant,
    returned_probs,
)
from llmem.components import activations as act
from llmem.components import communication as comm
from llmem.components import logits as lg
from llmem.components import quant_int8_traced as int8_traced
from llmem.components import step_in_backward as sib
from llmem.components import weight_gradient as wgrad
from llmem.components.gradients import (
    backward_end_gradient_bytes,
    embedding_gradient_accumulate_bytes,
    embedding_input_gradient_bytes,
    gradient_bytes,
    head_gradient_bytes,
    offloaded_embedding_transient_bytes,
    offloaded_head_transient_bytes,
    tied_gradient_sum_bytes,
)
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import parameter_bytes
from llmem.components.sharding import FSDP_SCHEMES
from llmem.plan import Engine, GradCkpt, Scheme, TrainingPlan
from llmem.spec import ModelSpec, program_spec
from llmem.walk.accumulation import accumulation_phases, gradients_kept
from llmem.walk.final_norm import final_norm_moment
from llmem.walk.float8 import float8_moments
from llmem.walk.layer import layer_moments
from llmem.walk.phase import Phase, moment, with_extra


@dataclass(frozen=True)
class Terms:
    """What the moments of one plan's walk share: the standing parts (`persistent`), the activations kept from
    forward, the autocast weight copies, the head's logits and loss, and the callables of the layer walk."""

    spec: ModelSpec
    plan: TrainingPlan
    persistent: dict
    grads_all: int
    grads_outer: int
    head_transient: int  # --offload optimizer, --ddp-bucket-view: the lm_head's gradient only when it is made
    embedding_transient: int  # ... and the embedding's
    kept: int  # one decoder layer's kept activations
    outer_act: int
    recompute: int  # a checkpointed layer during its backward (0 without checkpointing)
    held_layer: int  # --quant int8: each layer's 8-bit Linears' held inputs
    held_first: int
    partial: bool  # --ckpt-every K > 1
    varied: bool  # layers of several kinds (`activations.varied`)
    kept_layers: Callable
    current_layer: Callable
    forward_acts: int
    casts: int  # one layer's autocast weight copies (layer 0's)
    copies: tuple  # each layer's own (`autocast.each_layer_copy_bytes`)
    below: tuple  # [k]: those layers 0 .. k-1 keep into backward (the layers not checkpointed)
    head_cast: int
    fwd_casts: int
    first_casts: int
    base_casts: int
    logits: int
    loss_fwd: int
    loss_bwd: int
    head_bwd: int
    head_grad_copy: int
    gathered: Callable
    fwd_inflight: int = 0  # a traced last layer's forward transients beyond what it saves (`forward_inflight_bytes`)
    fwd_probs: int = 0  # a checkpointed last layer's softmax beside the previous layer's probabilities

    @property
    def layers(self) -> int:
        return self.spec.num_layers

    def copies_below(self, layer: int) -> int:
        """The weight copies the layers below `layer` keep into backward (those not checkpointed)."""
        return self.below[layer]


def _activation_terms(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """Kept activations: per layer (`kept`), outside the layers, a checkpointed layer's recompute; LoRA's frozen base
    keeps fewer inputs (layer 0 less still); --quant int8 Linears keep their inputs (quant.py)."""
    kept = act.kept_per_layer_bytes(spec, plan)
    outer_act = act.outer_saved_bytes(spec, plan)
    final_norm = act.final_norm_bytes(spec, plan)
    recompute = act.recompute_bytes(spec, plan) if act.checkpoints_layers(plan) else 0
    # (traced LoRA, `llmem.derive.lora`: the derived tables are LoRA's; layer 0 is a layer kind of its own)
    hand_lora = lora.is_lora(plan) and spec.derived is None
    if hand_lora:  # frozen base: fewer saved inputs, the adapters' own; layer 0 keeps less (see lora.py)
        final_norm = lora.final_norm_bytes(spec, plan) + lora_head.saved_bytes(spec, plan)  # an adapted lm_head's
        if plan.grad_ckpt is GradCkpt.FULL:
            # the checkpoint's own copy of the layer input, which in half precision no op of the layer saves
            recompute = act.recompute_bytes(spec, plan, lora.layer_activation_bytes(spec, plan)
                                            + act.checkpointed_input_extra_bytes(spec, plan))
        else:
            kept = lora.layer_activation_bytes(spec, plan)
            outer_act -= lora.first_layer_saving_bytes(spec, plan)  # layer 0 is alive in every phase below
    # --quant int8: each 8-bit Linear's autograd node keeps its input until the outputs are dropped (quant.py)
    held_layer, extra_layer = quant.held_input_bytes(spec, plan)
    held_first, extra_first = quant.held_input_bytes(spec, plan, first=True)
    partial = plan.grad_ckpt is GradCkpt.FULL and plan.ckpt_every > 1  # --ckpt-every K
    kept += extra_layer
    if not partial:  # (--ckpt-every K: each layer's own, `_int8_partial`)
        outer_act -= extra_layer - extra_first
    varied = act.varied(spec, plan)  # layers of several kinds: each counted by its own
    kept_layers, current_layer = act.kept_layers_bytes, act.current_layer_backward_bytes
    if hand_lora:
        kept_layers, current_layer = lora.kept_layers_bytes, lora.current_layer_backward_bytes
    if plan.grad_ckpt is GradCkpt.FULL and quant.is_int8(plan):  # (every K or every layer: `_int8_partial`)
        kept_layers, current_layer = _int8_partial(kept_layers, current_layer)
    if partial or varied:
        forward_acts = kept_layers(spec, plan, spec.num_layers) + outer_act + final_norm
    else:
        forward_acts = spec.num_layers * kept + outer_act + final_norm
    forward_acts += int8_traced.forward_end_bytes(spec, plan)  # traced --quant int8: checkpointed layers' inputs
    if act_offload.applies(plan):  # only the final norm's saved tensors stay (the forward stash); the layers' inputs
        # are on the host, and a layer's backward holds its recompute alone
        forward_acts, kept_layers = outer_act + final_norm, act_offload.layers_below_bytes
    return dict(kept=kept, outer_act=outer_act, recompute=recompute, held_layer=held_layer, held_first=held_first,
                partial=partial, varied=varied, kept_layers=kept_layers, current_layer=current_layer,
                forward_acts=forward_acts, fwd_inflight=forward_inflight_bytes(spec, plan, final_norm),
                fwd_probs=returned_probs.forward_extra_bytes(spec, plan, final_norm))


def _int8_partial(kept_layers: Callable, current_layer: Callable) -> tuple[Callable, Callable]:
    """`--quant int8 --grad-ckpt full [--ckpt-every K]`: each layer's held 8-bit inputs beyond its saved tensors
    (`quant.held_input_bytes` of a checkpointed layer or not, layer 0 its own), added to the layers kept below and to
    a non-checkpointed layer in its own backward (a checkpointed one's recompute holds them again: `layer.held_bytes`).
    A checkpointed layer below holds all of them from its first forward: checkpointing packs only saved tensors, and
    `MatMul8bitFp.forward` keeps its input as a node attribute, `ctx.A = A` (bitsandbytes 0.50.2
    autograd/_functions.py:269), alive while the loss's graph is (llama int8 fp32 4 x 128, h 256, every layer
    checkpointed: the last layer's backward read -1.74 % without layer 0's)."""
    def extra(spec, plan, j):
        return quant.held_input_bytes(spec, plan, first=j == 0, checkpointed=plan.checkpointed(j))[1]

    def kept(spec, plan, count):
        return kept_layers(spec, plan, count) + sum(extra(spec, plan, j) for j in range(count))

    def current(spec, plan, layer):
        return current_layer(spec, plan, layer) + (0 if plan.checkpointed(layer) else extra(spec, plan, layer))
    return kept, current


def forward_inflight_bytes(spec: ModelSpec, plan: TrainingPlan, final_norm: int) -> int:
    """A traced (derived) last decoder layer whose forward keeps its saves (not checkpointed, no activation
    offload): its transients beyond them (`Derived.forward_inflight_extra_bytes`) sit beside every earlier saved
    tensor before the final norm's saves exist, and beside the layer arguments no checkpoint holds (masks,
    position ids: the decoder's locals until it returns, `Derived.held_saved`'s tensors) and the other unsaved
    locals (`Derived.locals_bytes`), so the forward's end less `final_norm` plus them."""
    last = spec.num_layers - 1
    if plan.checkpointed(last) or act_offload.applies(plan):
        return 0
    if spec.derived is None:  # hand-written: the decoder's locals, GPT-NeoX's parallel add (`decoder_locals`)
        return decoder_locals.inflight_bytes(spec, plan, final_norm)
    d = spec.derived.at(last)
    lp = act.layer_plan(plan, last)
    # the arguments no checkpointed layer holds, of the whole plan (`--ckpt-every K`: layer 0's checkpoint holds
    # them, counted in `outer` by `checkpoint_held_saved`; read with the last layer's plan they counted twice)
    args = sum(s.bytes for s, low in zip(d._saved(plan, "held"), d.lowest_holders(plan), strict=True) if low is None)
    return max(0, d.forward_inflight_extra_bytes(lp) + args + d.locals_bytes(lp) - final_norm)


def _cast_terms(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """Autocast's weight copies. Backward runs after the autocast region has exited (its weight-copy cache cleared):
    a layer's copies survive only where autograd saved them — in layers that are not checkpointed, and in the layer
    being recomputed."""
    layers = spec.num_layers
    casts = autocast.layer_weight_copy_bytes(spec, plan)
    copies = autocast.each_layer_copy_bytes(spec, plan)  # layers of several kinds: each its own
    saved_casts = autocast.saved_layer_copies(plan, layers)
    below = _below(plan, copies)
    # held at the forward's end: every layer's (autocast's cache), or only the saved ones (`forward_copy_layers`)
    fwd_casts = sum(copies) if autocast.forward_copy_layers(spec, plan, layers) == layers else below[-1]
    first_casts = 0
    if lora.is_lora(plan) and casts and spec.derived is not None:
        # traced LoRA: the copies mm saves are in the layer tables; the adapters' cached copies of the checkpointed
        # layers live until the forward's autocast region exits (`llmem.derive.lora`)
        return dict(casts=0, copies=(0,) * layers, below=(0,) * (layers + 1), head_cast=_head_cast(spec, plan),
                    first_casts=0, base_casts=0,
                    fwd_casts=(layers - saved_casts) * lora.layer_adapter_cast_bytes(spec, plan))
    if lora.is_lora(plan) and autocast.applies(plan):  # (a 4-bit base has no copies: `quant_autocast`)
        # frozen base weights are not cached by autocast: their copies live only where mm saves them (layers not
        # checkpointed; in layer 0 only from the first adapted Linear on), in layer 0's and its recompute's moments
        # and below every later layer (`copies`, `below`); the adapters' copies stay in the cache to the forward's
        # end, layer 0's lora_A copies that no mm saved too (`lora.unsaved_adapter_copy_bytes`)
        first_casts = lora.first_layer_unsaved_copy_bytes(spec, plan)
        copies = (copies[0] - first_casts, *copies[1:])
        below = _below(plan, copies)
        fwd_casts = below[-1] + (layers - saved_casts) * lora.layer_adapter_cast_bytes(spec, plan) \
            + lora.unsaved_adapter_copy_bytes(spec, plan) * (not plan.checkpointed(0))
    return dict(casts=casts, copies=copies, below=below, head_cast=_head_cast(spec, plan), fwd_casts=fwd_casts,
                first_casts=first_casts, base_casts=below[-1])


def _below(plan: TrainingPlan, copies: tuple) -> tuple:
    """[k]: the weight copies layers 0 .. k-1 keep into backward (`copies`: each layer's own)."""
    return tuple(itertools.accumulate((c * s for c, s in zip(copies, _copy_savers(plan, len(copies)), strict=True)),
                                      initial=0))


def _copy_savers(plan: TrainingPlan, layers: int) -> list[bool]:
    """Whether each decoder layer keeps its weight copies into backward (`autocast.saved_layer_copies`): the layers
    not checkpointed (`TrainingPlan.checkpointed`)."""
    return [not plan.checkpointed(i) for i in range(layers)]


def _head_cast(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Autocast's half copies of the lm_head weight: one, cached; with --loss chunked-ce a frozen head's per chunk."""
    return autocast.head_weight_copy_bytes(spec, plan) * chunked_ce.head_weight_copies(spec, plan)


def _head_terms(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """The logits, the loss's forward and backward peaks, the lm_head's backward and its half weight gradient."""
    logits = lg.logits_bytes(spec, plan)
    loss_fwd, loss_bwd = lg.loss_forward_peak_bytes(spec, plan), lg.loss_backward_peak_bytes(spec, plan)
    head_bwd, head_grad_copy = lg.lm_head_backward_bytes(spec, plan), autocast.head_gradient_copy_bytes(spec, plan)
    if lora.is_lora(plan):  # the frozen lm_head makes no weight gradient to cast
        head_grad_copy = 0
    if fused_ce.is_fused(plan):  # --loss fused-linear-ce: no logits; grad_input and grad_weight made in forward
        logits, head_grad_copy = 0, 0
        loss_fwd, loss_bwd = fused_ce.loss_forward_peak_bytes(spec, plan), fused_ce.saved_bytes(spec, plan)
        head_bwd = fused_ce.grad_input_bytes(spec, plan)  # grad_weight is now the lm_head's .grad (gradients)
    return dict(logits=logits, loss_fwd=loss_fwd, loss_bwd=loss_bwd, head_bwd=head_bwd, head_grad_copy=head_grad_copy)


def terms(spec: ModelSpec, plan: TrainingPlan) -> Terms:
    persistent = dict(parameters=parameter_bytes(spec, plan), optimizer=optimizer_state_bytes(spec, plan),
                      standing=comm.standing_buffer_bytes(spec, plan))
    # --offload optimizer (offloaded gradients): a gradient's GPU life ends at its hook, so the lm_head's and the
    # embedding's are counted only at the moment they are made
    return Terms(spec=spec, plan=plan, persistent=persistent, grads_all=gradient_bytes(spec, plan),
                 grads_outer=head_gradient_bytes(spec, plan),
                 head_transient=offloaded_head_transient_bytes(spec, plan) + wgrad.head_transient_bytes(spec, plan),
                 embedding_transient=offloaded_embedding_transient_bytes(spec, plan),
                 gathered=comm.gathered_parameter_bytes(spec, plan),
                 **_activation_terms(spec, plan), **_cast_terms(spec, plan), **_head_terms(spec, plan))


def head_moments(t: Terms) -> list[Phase]:
    """The end of forward, the loss's forward and backward, the lm_head's backward (and, under autocast, its half
    weight gradient cast to fp32 once MmBackward0 has returned, its saved weight copy and input gradient freed)."""
    on = dict(**t.persistent, activations=t.forward_acts, communication=t.gathered(t.layers))
    fp32_grad = autocast.head_fp32_gradient_bytes(t.spec, t.plan) * bool(t.head_grad_copy)
    scaled = lora_head.backward_scaled_grad_bytes(t.spec, t.plan)  # an adapted lm_head's grad * scaling
    moe = moe_forward.forward_extra_bytes(t.spec, t.plan)  # inside the last layer's routed experts
    norm = moe_forward.final_norm_forward_extra_bytes(t.spec, t.plan)  # inside the final norm's forward
    phases = [
        moment("forward (last layer)", **on, temporaries=t.fwd_casts),
        *([moment("forward (last layer, in flight)", **dict(on, activations=t.forward_acts + t.fwd_inflight),
                  temporaries=t.fwd_casts)] if t.fwd_inflight else []),
        *([moment("forward (last layer, MoE experts)", **dict(on, activations=t.forward_acts + moe),
                  temporaries=t.fwd_casts)] if moe else []),
        *([moment(PROBS_MOMENT, **dict(on, activations=t.forward_acts + t.fwd_probs),
                  temporaries=t.fwd_casts - returned_probs.later_copy_bytes(t.spec, t.plan))] if t.fwd_probs else []),
        *([moment("final norm forward", **dict(on, activations=t.forward_acts + norm), temporaries=t.fwd_casts)]
          if norm else []),
        moment("loss forward", **on, temporaries=t.fwd_casts + t.head_cast, logits=t.loss_fwd),
        moment("loss backward", **on, temporaries=t.base_casts + t.head_cast, logits=t.loss_bwd),
        moment("lm_head backward", **on, gradients=t.grads_outer + t.head_transient - fp32_grad,
               temporaries=t.base_casts + t.head_cast + t.head_grad_copy, logits=t.head_bwd + scaled),
    ]
    down = lora_forward.down_proj_forward_extra_bytes(t.spec, t.plan)
    if down:  # inside the last layer's down_proj adapter (`lora_forward`)
        phases.insert(1, moment("forward (last layer), down_proj LoRA", **dict(on, activations=t.forward_acts + down),
                                temporaries=t.fwd_casts))
    if lora_head.targets_head(t.plan):  # the adapter's out-of-place add: base logits, scaled output, sum
        phases.insert(1, moment("lm_head forward, LoRA add", **on, temporaries=t.fwd_casts + t.head_cast,
                                logits=lora_head.forward_add_bytes(t.spec, t.plan)))
    if t.head_grad_copy:
        phases.append(moment("lm_head backward, weight gradient cast to fp32", **on,
                             gradients=t.grads_outer + t.head_transient,
                             temporaries=t.base_casts + t.head_grad_copy, logits=t.logits))
    step = sib.head_step_bytes(t.spec, t.plan)
    if step:  # --optimizer-in-backward: its hook steps the lm_head once MmBackward0 (and the cast) returned
        phases.append(moment("lm_head backward, its step in backward", **on, gradients=t.grads_outer + t.head_transient,
                             temporaries=t.base_casts + step, logits=t.logits))
    return phases


PROBS_MOMENT = "forward (last layer, softmax), previous layer's returned probabilities"  # (`returned_probs`)


def backward_edges(t: Terms) -> list[tuple[int, str]]:
    """The decoder layers whose backward is evaluated and their moments' names (`activations.backward_layers`)."""
    if t.partial or t.varied:
        return [(layer, f"backward (layer {layer}{', checkpointed' if t.plan.checkpointed(layer) else ''})")
                for layer in act.backward_layers(t.spec, t.plan)]
    return [(t.layers - 1, "backward (last layer)"), (0, "backward (first layer)")]


def qlora_moments(t: Terms, phases: list[Phase]) -> list[Phase]:
    """QLoRA: a 4-bit Linear's dequantized weight on top of the forward and the layer-backward moments."""
    if not quant.is_qlora(t.plan):
        return []
    out = [moment(f"forward (last layer), {quant.forward_moment_label(t.plan)}", **t.persistent,
                  activations=t.forward_acts, temporaries=quant.dequant_forward_bytes(t.spec, t.plan))]
    extra = quant.dequant_backward_extra_bytes(t.spec, t.plan)
    label = quant.bits(t.plan)
    return out + [with_extra(ph, f"{ph.name}, {label} weight dequantized", Category.TEMPORARIES, extra)
                  for ph in phases if ph.name.startswith("backward (") and "recompute" not in ph.name]


def end_moments(t: Terms) -> list[Phase]:
    """The end of backward (the embedding's gradient made; tied: the out-of-place sum of the two gradients, once the
    embedding's input gradient is freed) and the optimizer step. --quant int8: the held inputs until the outputs
    are dropped."""
    spec, plan = t.spec, t.plan
    held_all = (t.layers - 1) * t.held_layer + t.held_first + lora_forward.embedding_leaf_bytes(spec, plan) \
        + int8_traced.all_bytes(spec, plan)
    excess = spec.derived.gradient_excess_bytes(plan) if spec.derived is not None and plan.tp > 1 else 0
    end = dict(**t.persistent, gradients=backward_end_gradient_bytes(spec, plan) + t.embedding_transient + excess,
               logits=t.logits, activations=held_all)
    accumulate = embedding_gradient_accumulate_bytes(spec, plan)
    during, after = act_offload.embedding_backward_bytes(spec, plan) if act_offload.applies(plan) else (0, 0)
    phases = [moment("backward end", **dict(end, activations=held_all + during),
                     temporaries=accumulate + embedding_input_gradient_bytes(spec, plan))]
    tied_sum = tied_gradient_sum_bytes(spec, plan)
    if tied_sum:
        phases.append(moment("backward end, tied gradients summed", **dict(end, activations=held_all + after),
                             temporaries=accumulate + tied_sum))
    if sib.applies(plan):  # --optimizer-in-backward: the embedding's hook steps it, the last of backward; no step after
        stepped = dict(end, gradients=sib.embedding_gradient_bytes(spec, plan) + excess)
        step = sib.embedding_step_bytes(spec, plan)
        return phases + [moment("backward end, embedding step in backward", **stepped, temporaries=step)] * bool(step)
    phases.append(moment("optimizer step", **t.persistent, gradients=t.grads_all + excess, logits=t.logits,
                         activations=held_all, temporaries=optimizer_step_temporary_bytes(spec, plan)))
    return phases


def iteration_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """The candidate peak moments of one steady-state iteration on the largest rank."""
    spec = program_spec(spec, plan)
    if plan.engine is Engine.DEEPSPEED:
        from llmem.walk.deepspeed import deepspeed_phases

        return deepspeed_phases(spec, plan)
    if plan.engine is Engine.FSDP1:  # one GPU: NO_SHARD (`flat_param.sharded`)
        from llmem.walk.fsdp1 import fsdp1_phases

        return fsdp1_phases(spec, plan)
    if plan.scheme in FSDP_SCHEMES:
        from llmem.walk.fsdp import fsdp_phases

        return fsdp_phases(spec, plan)
    t = terms(spec, plan)
    phases = head_moments(t) + final_norm_moment(t)
    # moment -> the later layers' gradients there (for --grad-accum; the final norm's: none, the head's `.grad`s)
    backward_later: dict[str, int] = {"final norm backward": 0}
    # MLP moment -> the layer's own gradients already .grads there (read by --grad-accum's phases only)
    mlp_held: dict[str, int] | None = {} if gradients_kept(plan) else None
    for layer, name in backward_edges(t):
        phases += layer_moments(t, layer, name, backward_later, mlp_held)
    phases += float8_moments(t, backward_edges(t))
    phases += qlora_moments(t, phases)
    phases += end_moments(t)
    if gradients_kept(plan):
        phases += accumulation_phases(spec, plan, phases, backward_later, mlp_held)
    phases += rebuild_moments(t)
    return phases


def rebuild_moments(t: Terms) -> list[Phase]:
    """DDP / ZeRO-1 with `--ddp-bucket-view` and `--grad-accum K > 1`: `Reducer::rebuild_buckets` at the start of
    micro-step 2's forward of iteration 1 holds the old buckets (viewed by micro-step 1's `.grad`s) beside the new
    (`comm.ddp_rebuild_bytes`). It comes before the first `optimizer.step()`, and every optimizer here makes its states
    lazily in `step` (torch/optim/sgd.py and adam.py `_init_group`, bitsandbytes `Optimizer8bit.init_state`): none
    yet. With `--keep-grads` and K = 1 the `.grad`s zeroed in place view the old buckets at iteration 2's forward,
    beside the optimizer states. Otherwise the rebuild frees the old buckets first and is no moment of its own."""
    rebuild = comm.ddp_rebuild_bytes(t.spec, t.plan)
    if not rebuild or t.plan.scheme not in (Scheme.DDP, Scheme.ZERO1):
        return []
    if t.plan.grad_accum == 1:  # --keep-grads: iteration 2's forward, after the first step made the states
        return [moment("DDP bucket rebuild (iteration 2, gradients kept)", **t.persistent, communication=rebuild)]
    return [moment("DDP bucket rebuild (micro-step 2 of iteration 1)", parameters=t.persistent["parameters"],
                   standing=t.persistent["standing"], communication=rebuild)]
