"""Walk one steady-state iteration (DESIGN.md section 1) phase by phase and take the largest live total.

Iteration 2 is the steady state: optimizer states exist from the start. Decoder layers are identical, so the walk
evaluates the phases where live memory can peak — the end of forward, the loss forward and backward, the lm_head
backward, the backward of the first and last decoder layers, the end of backward, and the optimizer step — each as
a breakdown by category that sums exactly to the phase total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial as partial_fn

from llmem.components import Category, autocast, fused_ce, lora, offload, outside, quant
from llmem.components import activations as act
from llmem.components import attention_core as core
from llmem.components import communication as comm
from llmem.components import logits as lg
from llmem.components import norm_backward as norm_bwd
from llmem.components.gradients import (
    accumulated_embedding_gradient_bytes,
    attention_backward_layer_gradient_bytes,
    embedding_gradient_accumulate_bytes,
    embedding_input_gradient_bytes,
    gradient_bytes,
    head_gradient_bytes,
    later_layers_gradient_bytes,
    layer_backward_peak_extra_bytes,
    layer_gradient_bytes,
    layer_output_gradient_bytes,
    offloaded_embedding_transient_bytes,
    offloaded_head_transient_bytes,
    tied_gradient_sum_bytes,
)
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes, paged_state_bytes
from llmem.components.parameters import parameter_bytes
from llmem.components.sharding import FSDP_SCHEMES, local_numel, shard_summary
from llmem.plan import GradCkpt, Offload, Precision, Scheme, TrainingPlan
from llmem.spec import ModelSpec


@dataclass(frozen=True)
class Phase:
    name: str
    breakdown: dict  # Category -> bytes

    @property
    def total(self) -> int:
        return sum(self.breakdown.values())


@dataclass(frozen=True)
class Estimate:
    """What one rank's steady-state iteration costs. Sizes in bytes; `breakdown` sums to `peak_bytes`."""

    spec: ModelSpec
    plan: TrainingPlan
    peak_phase: str
    breakdown: dict  # Category -> bytes at the peak
    phases: tuple[Phase, ...] = field(repr=False)
    cuda_context_bytes: int = 0
    fragmentation_bytes: int = 0
    paged_state_bytes: int = 0  # PagedAdamW8bit on CUDA: states in unified memory, outside the allocator
    host_breakdown: dict = field(default_factory=dict)  # Category -> host bytes per rank (--offload), not in peak
    host_pinned_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        """Host memory one rank holds at its largest (offloaded parameters, gradients, optimizer states, step)."""
        return sum(self.host_breakdown.values())

    @property
    def host_node_bytes(self) -> int:
        """Host memory of one node: every rank on it holds its own shard."""
        return self.host_bytes * offload.ranks_per_node(self.plan)

    @property
    def peak_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def reserved_bytes(self) -> int:
        """Predicted `max_memory_reserved`: the peak plus the caching allocator's rounding and fragmentation."""
        return self.peak_bytes + self.fragmentation_bytes

    @property
    def device_total_bytes(self) -> int:
        """What `nvidia-smi` shows: reserved memory plus the CUDA context and the paged optimizer states (unified
        memory resident on the GPU) outside the allocator."""
        return self.reserved_bytes + self.cuda_context_bytes + self.paged_state_bytes

    @property
    def notes(self) -> tuple[str, ...]:
        """Plain-language facts about the plan (e.g. FSDP2 padding small tensors to the rank count)."""
        from llmem.notes import plan_notes

        return plan_notes(self.spec, self.plan)

    @property
    def total_params(self) -> int:
        """Every parameter of the model that runs (LoRA: base plus adapters)."""
        return lora.total_params(self.spec, self.plan)

    @property
    def trainable_params(self) -> int:
        return lora.trainable_params(self.spec, self.plan)

    def to_dict(self) -> dict:
        return {
            "model": self.spec.name,
            "model_type": self.spec.model_type,
            "plan": self.plan.to_dict(),
            "scheme": str(self.plan.scheme),
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "breakdown": {str(k): v for k, v in self.breakdown.items()},
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "cuda_context_bytes": self.cuda_context_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "paged_state_bytes": self.paged_state_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "host_bytes": self.host_bytes,
            "host_breakdown": {str(k): v for k, v in self.host_breakdown.items()},
            "host_pinned_bytes": self.host_pinned_bytes,
            "host_node_bytes": self.host_node_bytes,
            "host_ranks_per_node": offload.ranks_per_node(self.plan),
            "phases": {p.name: p.total for p in self.phases},
            "notes": list(self.notes),
        }


_PART_CATEGORY = {c.name.lower(): c for c in Category} | {"standing": Category.COMMUNICATION}
_EMPTY = dict.fromkeys(Category, 0)


def _phase(name: str, **parts: int) -> Phase:
    breakdown = dict(_EMPTY)
    for key, value in parts.items():
        breakdown[_PART_CATEGORY[key]] += value
    return Phase(name, breakdown)


def iteration_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """The candidate peak moments of one steady-state iteration on the largest rank."""
    if plan.scheme in FSDP_SCHEMES:
        return fsdp_phases(spec, plan)
    layers, last = spec.num_layers, spec.num_layers - 1
    persistent = dict(parameters=parameter_bytes(spec, plan), optimizer=optimizer_state_bytes(spec, plan),
                      standing=comm.standing_buffer_bytes(spec, plan))
    grads_all, grads_outer = gradient_bytes(spec, plan), head_gradient_bytes(spec, plan)
    # --offload optimizer (offloaded gradients): a gradient's GPU life ends at its hook, so the lm_head's and the
    # embedding's are counted only at the moment they are made
    head_transient = offloaded_head_transient_bytes(spec, plan)
    embedding_transient = offloaded_embedding_transient_bytes(spec, plan)
    kept = act.kept_per_layer_bytes(spec, plan)
    outer_act = act.outer_saved_bytes(spec, plan)
    final_norm = act.final_norm_bytes(spec, plan)
    recompute = 0
    if plan.grad_ckpt is GradCkpt.FULL:
        recompute = act.recompute_bytes(spec, plan)
    if lora.is_lora(plan):  # frozen base: fewer saved inputs, the adapters' own; layer 0 keeps less (see lora.py)
        final_norm = lora.final_norm_bytes(spec, plan)
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
    kept += extra_layer
    outer_act -= extra_layer - extra_first
    partial = plan.grad_ckpt is GradCkpt.FULL and plan.ckpt_every > 1  # --ckpt-every K
    kept_layers, current_layer = act.kept_layers_bytes, act.current_layer_backward_bytes
    if lora.is_lora(plan):
        kept_layers, current_layer = lora.kept_layers_bytes, lora.current_layer_backward_bytes
    if partial:
        forward_acts = kept_layers(spec, plan, layers) + outer_act + final_norm
    else:
        forward_acts = layers * kept + outer_act + final_norm
    casts = autocast.layer_weight_copy_bytes(spec, plan)
    head_cast = autocast.head_weight_copy_bytes(spec, plan)
    logits = lg.logits_bytes(spec, plan)
    gathered = comm.gathered_parameter_bytes(spec, plan)
    # Backward runs after the autocast region has exited (its weight-copy cache cleared): a layer's copies survive
    # only where autograd saved them — in layers that are not checkpointed, and in the layer being recomputed.
    saved_casts = autocast.saved_layer_copies(plan, layers)
    fwd_casts, first_casts = layers * casts, 0
    if lora.is_lora(plan) and casts:
        # frozen base weights are not cached by autocast: their copies live only where mm saves them (layers not
        # checkpointed; in layer 0 only from the first adapted Linear on); the adapters' copies stay in the cache
        first_casts = lora.first_layer_unsaved_copy_bytes(spec, plan)
        fwd_casts = saved_casts * casts - first_casts * (not plan.checkpointed(0)) \
            + (layers - saved_casts) * lora.layer_adapter_cast_bytes(spec, plan)
    base_casts = saved_casts * casts - first_casts * (not plan.checkpointed(0))

    loss_fwd, loss_bwd = lg.loss_forward_peak_bytes(spec, plan), lg.loss_backward_peak_bytes(spec, plan)
    head_bwd, head_grad_copy = lg.lm_head_backward_bytes(spec, plan), autocast.head_gradient_copy_bytes(spec, plan)
    if lora.is_lora(plan):  # the frozen lm_head makes no weight gradient to cast
        head_grad_copy = 0
    if fused_ce.is_fused(plan):  # --loss fused-linear-ce: no logits; grad_input and grad_weight made in forward
        logits, head_grad_copy = 0, 0
        loss_fwd, loss_bwd = fused_ce.loss_forward_peak_bytes(spec, plan), fused_ce.saved_bytes(spec, plan)
        head_bwd = fused_ce.grad_input_bytes(spec, plan)  # grad_weight is now the lm_head's .grad (gradients)
    phases = [
        _phase("forward (last layer)", **persistent, activations=forward_acts,
               temporaries=fwd_casts, communication=gathered(layers)),
        _phase("loss forward", **persistent, activations=forward_acts, temporaries=fwd_casts + head_cast,
               logits=loss_fwd, communication=gathered(layers)),
        _phase("loss backward", **persistent, activations=forward_acts, temporaries=base_casts + head_cast,
               logits=loss_bwd, communication=gathered(layers)),
        _phase("lm_head backward", **persistent, activations=forward_acts,
               gradients=grads_outer + head_transient
               - autocast.head_fp32_gradient_bytes(spec, plan) * bool(head_grad_copy),
               temporaries=base_casts + head_cast + head_grad_copy,
               logits=head_bwd, communication=gathered(layers)),
    ]
    if head_grad_copy:  # autocast: MmBackward0 has returned (its saved weight copy and input gradient freed)
        phases.append(_phase("lm_head backward, weight gradient cast to fp32", **persistent, activations=forward_acts,
                             gradients=grads_outer + head_transient, temporaries=base_casts + head_grad_copy,
                             logits=logits, communication=gathered(layers)))
    edges = [(last, "backward (last layer)"), (0, "backward (first layer)")]
    if partial:
        edges = [(layer, f"backward (layer {layer}{', checkpointed' if plan.checkpointed(layer) else ''})")
                 for layer in act.backward_layers(spec, plan)]
    backward_later = {}
    for layer, name in edges:
        later = backward_later[name] = later_layers_gradient_bytes(spec, plan, layer)
        if partial or lora.is_lora(plan):  # (LoRA: layer 0's recompute keeps what its no-grad input lets it)
            held = kept_layers(spec, plan, layer) + current_layer(spec, plan, layer)
        else:
            held = layer * kept + (recompute or kept)
        mlp_dropout = act.mlp_output_dropout_bytes(spec, act.layer_plan(plan, layer))  # freed by now
        # 8-bit Linears' inputs of the layers whose backward ran (and, checkpointed, of the one recomputing)
        held += (layers - 1 - layer + bool(recompute)) * held_layer + quant.held_past_adapter_bytes(spec, plan)
        lp = act.layer_plan(plan, layer)
        post_norm = norm_bwd.post_mlp_norm_saved_bytes(spec, act.layer_saved(spec, lp))  # released by now
        phases.append(_phase(
            name, **persistent,
            activations=held + outer_act - mlp_dropout - post_norm,
            gradients=grads_outer + later + layer_backward_peak_extra_bytes(spec, act.layer_plan(plan, layer)),
            temporaries=(autocast.saved_layer_copies(plan, layer) + 1) * casts
            - first_casts * (not plan.checkpointed(0) or layer == 0)
            - autocast.released_by_mlp_backward_bytes(spec, act.layer_plan(plan, layer)),
            logits=logits, communication=gathered(layer + 1) + comm.backward_transient_bytes(spec, plan),
        ))
        if norm_bwd.applies(spec) and not lora.is_lora(plan):  # gemma2: the post-feedforward norm runs first
            phase = f"{name[:-1]}, post-feedforward norm)"
            backward_later[phase] = later
            phases.append(_phase(
                phase, **persistent, activations=held + outer_act,
                gradients=grads_outer + later + layer_output_gradient_bytes(spec, plan)
                + norm_bwd.post_mlp_norm_backward_bytes(spec, plan),
                temporaries=(autocast.saved_layer_copies(plan, layer) + 1) * casts,
                logits=logits, communication=gathered(layer + 1) + comm.backward_transient_bytes(spec, plan)))
        # a checkpointed LoRA layer during the recompute of its forward (`lora.recompute_moments`)
        for moment, (fwd, grads) in (lora.recompute_moments(spec, plan) if plan.checkpointed(layer) else {}).items():
            phase = f"{name[:-1]}, {moment})"
            backward_later[phase] = later
            phases.append(_phase(
                phase, **persistent, activations=held + outer_act + sum(s.bytes for s in fwd),
                gradients=grads_outer + later + layer_output_gradient_bytes(spec, plan) + sum(s.bytes for s in grads),
                temporaries=(autocast.saved_layer_copies(plan, layer) + 1) * casts,
                logits=logits, communication=gathered(layer + 1)))
        if core.applies(spec, plan):
            lp = act.layer_plan(plan, layer)
            saved = tuple(lora.layer_saved(spec, lp)) if lora.is_lora(plan) else act.layer_saved(spec, lp)
            phases.append(_phase(
                f"{name[:-1]}, attention core)", **persistent,
                activations=held + outer_act - core.eager_core_released(spec, lp, saved),
                gradients=grads_outer + later + core.eager_core_layer_gradient_bytes(spec, plan)
                + core.eager_core_transient_bytes(spec, lp, saved),
                temporaries=autocast.saved_layer_copies(plan, layer) * casts
                + core.eager_core_weight_copy_bytes(spec, plan),
                logits=logits, communication=gathered(layer + 1)))
        if act.falcon_math_attention(spec, plan) and not lora.is_lora(plan):
            phases.append(_phase(
                f"{name[:-1]}, attention core)", **persistent,
                activations=held + outer_act - mlp_dropout - act.attention_backward_freed_bytes(spec, plan),
                gradients=grads_outer + later + attention_backward_layer_gradient_bytes(spec, plan),
                temporaries=autocast.saved_layer_copies(plan, layer) * casts
                + autocast.attention_backward_weight_copy_bytes(spec, plan)
                + act.attention_backward_transient_bytes(spec, plan),
                logits=logits, communication=gathered(layer + 1)))
    if quant.is_qlora(plan):  # a 4-bit Linear's dequantized weight on top of the forward / layer-backward moments
        phases.append(_phase(f"forward (last layer), {quant.forward_moment_label(plan)}", **persistent,
                             activations=forward_acts, temporaries=quant.dequant_forward_bytes(spec, plan)))
        extra = quant.dequant_backward_extra_bytes(spec, plan)
        for ph in [p for p in phases if p.name.startswith("backward (") and "recompute" not in p.name]:
            b = dict(ph.breakdown)
            b[Category.TEMPORARIES] += extra
            phases.append(Phase(f"{ph.name}, {quant.bits(plan)} weight dequantized", b))
    held_all = (layers - 1) * held_layer + held_first  # --quant int8: kept until the outputs are dropped
    phases.append(_phase("backward end", **persistent, gradients=grads_all + embedding_transient, logits=logits,
                         activations=held_all,
                         temporaries=embedding_gradient_accumulate_bytes(spec, plan)
                         + embedding_input_gradient_bytes(spec, plan)))
    tied_sum = tied_gradient_sum_bytes(spec, plan)
    if tied_sum:  # the embedding's input gradient is freed once its backward returned; the out-of-place sum
        phases.append(_phase("backward end, tied gradients summed", **persistent,
                             gradients=grads_all + embedding_transient, logits=logits, activations=held_all,
                             temporaries=embedding_gradient_accumulate_bytes(spec, plan) + tied_sum))
    phases.append(_phase("optimizer step", **persistent, gradients=grads_all, logits=logits, activations=held_all,
                         temporaries=optimizer_step_temporary_bytes(spec, plan)))
    if plan.grad_accum > 1:
        phases += accumulation_phases(spec, plan, phases, backward_later)
    if plan.scheme in (Scheme.DDP, Scheme.ZERO1):
        # Iteration 2's forward starts with `Reducer::rebuild_buckets`: new buckets before the old are freed.
        phases.append(_phase("DDP bucket rebuild", **persistent, communication=comm.ddp_rebuild_bytes(spec, plan)))
    return phases


def accumulation_phases(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase],
                        backward_later: dict[str, int] | None = None) -> list[Phase]:
    """`--grad-accum K > 1`: micro-steps 2..K run forward and backward while every gradient of the previous
    micro-steps is alive (`.grad` is only freed by zero_grad after the step). The forward and loss phases of micro-
    step 1 gain all gradients; in the backward phases the gradients micro-step 1 had (the newly produced ones:
    the lm_head's, a layer's MLP weight gradient) are now transient — AccumulateGrad adds each new gradient into the
    existing `.grad` in place and frees it — on top of all gradients. At the end of backward one more embedding-sized
    gradient is new beside the `.grad`s (`accumulated_embedding_gradient_bytes`: the embedding's, or when tied the
    lm_head's)."""
    grads_all = gradient_bytes(spec, plan)
    later = dict(backward_later) if backward_later is not None else {
        "backward (last layer)": later_layers_gradient_bytes(spec, plan, spec.num_layers - 1),
        "backward (first layer)": later_layers_gradient_bytes(spec, plan, 0)}
    # an attention core runs backward after the layer's MLP and output projection gradients were accumulated
    attention_grads = (core.eager_core_layer_gradient_bytes(spec, plan) if core.applies(spec, plan)
                       else attention_backward_layer_gradient_bytes(spec, plan))
    later |= {f"{name[:-1]}, attention core)": v + attention_grads for name, v in later.items()}
    out, ends = [], []
    for ph in phases:
        if ph.name.startswith("backward end"):
            ends.append(ph)
            continue
        if ph.name == "optimizer step":
            continue
        b = dict(ph.breakdown)
        new = b[Category.GRADIENTS] - later.get(ph.name, 0)  # what this moment of micro-step 1 had just produced
        b[Category.GRADIENTS] = grads_all + new
        out.append(Phase(f"{ph.name}, gradients alive (micro-step 2)", b))
    new_grad = accumulated_embedding_gradient_bytes(spec, plan)
    for ph in ends:
        b = dict(ph.breakdown)
        b[Category.TEMPORARIES] += new_grad
        what = "tied gradients summed" if ph.name.endswith("summed") else "embedding gradient accumulated"
        out.append(Phase(f"backward end, {what} (micro-step 2)", b))
    return out


def compute_plan(plan: TrainingPlan) -> TrainingPlan:
    """The plan whose single-device walk matches one FSDP2 rank's compute: TP-local tensors, unsharded; under a
    MixedPrecisionPolicy the whole forward runs in the half dtype (no autocast), as pure half precision does."""
    precision = plan.precision
    if precision.is_mixed:
        precision = Precision.BF16 if precision is Precision.BF16_MIXED else Precision.FP16
    return plan.with_(gpus=plan.tp, zero=0, precision=precision, offload=Offload.NONE)


def fsdp_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """FSDP2 (ZeRO-2/3, and TP x FSDP2): the walk of `iteration_phases` with FSDP2's buffers
    (see `llmem.components.communication`). Gradients of the root stay unsharded in param_dtype until the final
    callback; a layer's unsharded gradients exist from its backward to its reduce-scatter."""
    cp = compute_plan(plan)
    layers = spec.num_layers
    persistent = dict(parameters=parameter_bytes(spec, plan), optimizer=optimizer_state_bytes(spec, plan))
    # --offload optimizer+params: sharded parameters, sharded gradients, optimizer states and the step live on the
    # host (`llmem.components.offload`); a reduce-scatter output is on the GPU only until its copy to the host.
    resident = 0 if offload.is_offloaded(plan) else 1
    persistent = {k: v * resident for k, v in persistent.items()}
    kept = act.kept_per_layer_bytes(spec, cp)
    outer_act = act.outer_saved_bytes(spec, cp)
    forward_acts = act.kept_layers_bytes(spec, cp, layers) + outer_act + act.final_norm_bytes(spec, cp)
    recompute = 0
    if plan.grad_ckpt is GradCkpt.FULL:
        recompute = act.recompute_bytes(spec, cp)
    first_saving = 0
    # LoRA under a MixedPrecisionPolicy: the adapters are all-gathered in the half dtype too and compute in it
    half = lora.half_adapters(plan)
    adapter_grad = cp.precision.compute_bytes if half else lora.ADAPTER_BYTES  # unsharded adapter gradients
    if lora.is_lora(plan):  # as in `iteration_phases`: the frozen base's saved tensors, the adapters' own
        if plan.grad_ckpt is GradCkpt.FULL:
            # the checkpoint's own copy of the layer input, which in half precision no op of the layer saves
            recompute = lora.recompute_bytes(spec, cp, half)
        else:
            kept = lora.layer_activation_bytes(spec, cp, half=half)
            first_saving = lora.first_layer_saving_bytes(spec, cp, half)  # layer 0 keeps less while its saves live
        forward_acts = lora.kept_layers_bytes(spec, cp, layers, half=half) - first_saving + outer_act \
            + lora.final_norm_bytes(spec, cp)
    logits = lg.logits_bytes(spec, cp)
    root_grads_head = head_gradient_bytes(spec, cp)  # unsharded, param_dtype
    pb = plan.precision.param_bytes
    sharded_layer = [n * pb for n in shard_summary(spec, plan).per_layer]
    if lora.is_lora(plan):  # only the adapters have gradients
        sharded_layer = lora.sharded_layer_adapter_bytes(spec, plan)
    layer_grads = layer_gradient_bytes(spec, cp, 0)  # unsharded, param_dtype
    if lora.is_lora(plan):
        layer_grads = lora.layer_adapter_bytes(spec, cp, 0, adapter_grad)
    residual_grad = plan.batch_size * plan.seq_len * spec.hidden_size * cp.precision.param_bytes  # d(layer output)
    rs_in = comm.layer_reduce_scatter_input_bytes(spec, plan)
    bwd_head = comm.backward_gather_bytes(spec, plan, None)
    root_gather, layer_gather = comm.root_unsharded_bytes(spec, plan), comm.layer_unsharded_bytes(spec, plan)
    # The start of forward: the root's pre-forward all-gather (the step's input_ids alive), its copy-out (the
    # output beside the new unsharded storage); then, with the embeddings' output (layer 0's input) alive, layer 0's
    # all-gather and copy-out while the root's output is still retained (`all_gather_state`) beside the root's
    # unsharded parameters. Each copy-out frees the retained output only when it returns (`wait_for_unshard` holds
    # it in a local), so later forward all-gathers and copy-outs hold one retained layer output: the last layer's
    # are the largest (ZeRO-2 keeps every earlier layer gathered, ZeRO-3 only the activations grow).
    ids = sum(s.bytes for s in act.outer_saved(spec, cp) if s.name.startswith("input_ids"))
    hidden = act.checkpointed_layer_bytes(spec, cp)  # the hidden states entering a layer
    phases = [
        _phase("forward (root all-gather)", **persistent, activations=ids,
               communication=comm.all_gather_bytes(spec, plan, root=True)),
        _phase("forward (root all-gather copy-out)", **persistent, activations=ids,
               communication=2 * root_gather + comm.shard_dim1_copy_out_bytes(spec, plan, root=True)),
        _phase("forward (layer 0 all-gather)", **persistent, activations=outer_act + hidden,
               communication=2 * root_gather + comm.all_gather_bytes(spec, plan)),
        _phase("forward (layer 0 all-gather copy-out)", **persistent, activations=outer_act + hidden,
               communication=2 * root_gather + 2 * layer_gather + comm.shard_dim1_copy_out_bytes(spec, plan)),
    ]
    if layers > 1:
        earlier_layers = (layers - 1) * kept - first_saving if lora.is_lora(plan) else act.kept_layers_bytes(
            spec, cp, layers - 1)
        unsharded = (layers - 1) * layer_gather if plan.scheme is Scheme.ZERO2 else 0
        # the model's forward holds the embeddings' output (`inputs_embeds`) through its layer loop: extra where no
        # op of layer 0 saves it (LoRA: layer 0's input needs no grad; a half-precision RMSNorm saves its fp32 copy)
        embeds = 0
        if plan.grad_ckpt is not GradCkpt.FULL and (lora.is_lora(plan) or not any(
                s.name.startswith("input (residual stream") for s in act.layer_saved(spec, cp))):
            embeds = hidden
        phases.append(_phase(
            f"forward (layer {layers - 1} all-gather)", **persistent,
            activations=earlier_layers + outer_act + embeds + hidden,
            communication=root_gather + unsharded + layer_gather + comm.all_gather_bytes(spec, plan)))
        # its copy-out: `wait_for_unshard` binds the retained output of layer L-2 to a local
        # (`prev_all_gather_state`), so it is freed only when the copy-out returns
        phases.append(_phase(
            f"forward (layer {layers - 1} all-gather copy-out)", **persistent,
            activations=earlier_layers + outer_act + embeds + hidden,
            communication=root_gather + unsharded + 3 * layer_gather + comm.shard_dim1_copy_out_bytes(spec, plan)))
    phases += [
        _phase("forward (last layer)", **persistent, activations=forward_acts,
               communication=comm.forward_gather_bytes(spec, plan, in_layer=True)),
        _phase("loss forward", **persistent, activations=forward_acts, logits=lg.loss_forward_peak_bytes(spec, cp),
               communication=comm.forward_gather_bytes(spec, plan, in_layer=False)),
        _phase("loss backward", **persistent, activations=forward_acts,
               logits=lg.loss_backward_peak_bytes(spec, cp), communication=bwd_head),
        _phase("lm_head backward", **persistent, activations=forward_acts, gradients=root_grads_head,
               logits=lg.lm_head_backward_bytes(spec, cp), communication=bwd_head),
    ]
    if comm.root_resharded_after_forward(plan):
        loss_fwd = next(i for i, ph in enumerate(phases) if ph.name == "loss forward")
        # ZeRO-3: the root's pre-backward (a hook on the loss, before its backward) all-gathers the root again, copies
        # it out, and prefetches the last layer (`_backward_prefetch`); the forward's saved tensors and the loss's
        # are alive, the last layer's retained output was freed by the root's post-forward.
        at_start = dict(**persistent, activations=forward_acts, logits=lg.loss_backward_start_bytes(spec, cp))
        phases[loss_fwd + 1:loss_fwd + 1] = [
            _phase("loss backward (root pre-backward all-gather)", **at_start,
                   communication=comm.all_gather_bytes(spec, plan, root=True)),
            _phase("loss backward (root pre-backward copy-out)", **at_start,
                   communication=2 * root_gather + comm.shard_dim1_copy_out_bytes(spec, plan, root=True)),
            _phase(f"loss backward (prefetch of layer {layers - 1})", **at_start,
                   communication=root_gather + comm.all_gather_bytes(spec, plan)),
        ]
    # Live bytes are linear in the layer index between the edges (prefetch only for l > 0, a retained
    # reduce_scatter_input only for l < L-1), so the extremes are among the two outermost layers at each end.
    # With --ckpt-every K > 1 the same holds within each residue class mod K (`activations.backward_layers`).
    partial = plan.grad_ckpt is GradCkpt.FULL and plan.ckpt_every > 1
    held = {}  # phase -> the sharded gradients micro-step 1 already holds there (for --grad-accum)
    for layer in act.backward_layers(spec, plan, edge=2):
        later = sum(sharded_layer[layer + 1:]) * resident
        held |= {f"{what} (layer {layer}{where})": later for where in ("", ", attention core")
                 for what in ("backward", "reduce-scatter copy-in", "reduce-scatter")}
        retained = rs_in if layer < layers - 1 else 0  # the previous layer's reduce_scatter_input
        kept_layers, current_layer = act.kept_layers_bytes, act.current_layer_backward_bytes
        if lora.is_lora(plan):  # (half adapters under a MixedPrecisionPolicy)
            kept_layers = partial_fn(lora.kept_layers_bytes, half=half)
            current_layer = partial_fn(lora.current_layer_backward_bytes, half=half)
        below = kept_layers(spec, cp, layer)
        current = current_layer(spec, cp, layer) if partial or lora.is_lora(plan) else (recompute or kept)
        if plan.scheme is not Scheme.ZERO2:  # ZeRO-3 (and TP x FSDP2) all-gather again in backward
            # The layer's pre-backward (`FSDPParamGroup.pre_backward`): its saved tensors and the gradient of its
            # output alive, its copy-out (new unsharded storage beside its prefetched all-gather output, freed
            # next), then the prefetch of layer - 1 (`_backward_prefetch`): a new all-gather output while the
            # unsharded parameters stay, and on CPU gloo's flat output inside the all-gather.
            own = kept_layers(spec, cp, layer + 1) - kept_layers(spec, cp, layer)
            phases.append(_phase(
                f"backward (layer {layer}, pre-backward all-gather)", **persistent,
                activations=below + outer_act + own - first_saving,
                gradients=root_grads_head + later + residual_grad,
                logits=logits, communication=comm.pre_backward_gather_bytes(spec, plan, layer) + retained))
            held[f"backward (layer {layer}, pre-backward all-gather)"] = later
        mlp_dropout = act.mlp_output_dropout_bytes(spec, act.layer_plan(cp, layer))  # freed by the MLP's backward
        phases.append(_phase(
            f"backward (layer {layer})", **persistent,
            activations=below + outer_act + current - first_saving - mlp_dropout,
            gradients=root_grads_head + later
            + layer_backward_peak_extra_bytes(spec, act.layer_plan(cp, layer), adapter_grad),
            logits=logits, communication=comm.backward_gather_bytes(spec, plan, layer) + retained))
        end = lora_recompute_end(spec, plan, cp) if not partial else None
        if end is not None:  # see `lora_recompute_end`
            live, grads = end
            phases.append(_phase(
                f"backward (layer {layer}, end of its recompute)", **persistent,
                activations=below + outer_act + current - (first_saving if layer == 0 else 0) + live,
                gradients=root_grads_head + later + residual_grad + grads,
                logits=logits, communication=comm.backward_gather_bytes(spec, plan, layer) + retained))
            held[f"backward (layer {layer}, end of its recompute)"] = later
        if lora.is_lora(plan) and not half and not partial:  # fp32 adapters: the single-GPU recompute moments
            for moment, (fwd, grads) in lora.recompute_moments(spec, cp).items():
                phase = f"backward (layer {layer}, {moment})"
                phases.append(_phase(
                    phase, **persistent, activations=below + outer_act + current + sum(s.bytes for s in fwd),
                    gradients=root_grads_head + later + residual_grad + sum(s.bytes for s in grads),
                    logits=logits, communication=comm.backward_gather_bytes(spec, plan, layer) + retained))
                held[phase] = later
        if act.falcon_math_attention(spec, plan):
            phases.append(_phase(
                f"backward (layer {layer}, attention core)", **persistent,
                activations=below + outer_act + current - mlp_dropout - act.attention_backward_freed_bytes(spec, cp),
                gradients=root_grads_head + later + attention_backward_layer_gradient_bytes(spec, cp),
                temporaries=act.attention_backward_transient_bytes(spec, cp),
                logits=logits, communication=comm.backward_gather_bytes(spec, plan, layer) + retained))
        earlier = dict(**persistent, activations=below + outer_act - (first_saving if layer else 0), logits=logits)
        gather = comm.backward_gather_bytes(spec, plan, layer, own=False) + comm.shard_dim1_reduce_bytes(spec, plan)
        phases.append(_phase(  # foreach_reduce copy-in: the unsharded grads into reduce_scatter_input
            f"reduce-scatter copy-in (layer {layer})", **earlier,
            gradients=root_grads_head + later + layer_grads,
            communication=gather + rs_in + comm.chunk_cat_padding_bytes(spec, plan)))
        phases.append(_phase(  # the collective: unsharded grads freed, the output shard and gloo's copy allocated
            f"reduce-scatter (layer {layer})", **earlier, gradients=root_grads_head + later + sharded_layer[layer],
            communication=gather + rs_in + comm.reduce_scatter_scratch_bytes(spec, plan)))
    if quant.is_qlora(plan):  # a 4-bit Linear's dequantized weight (`quant.py`: the gathered codes + quant_state)
        phases.append(_phase(f"forward (last layer), {quant.forward_moment_label(cp)}", **persistent,
                             activations=forward_acts, temporaries=quant.dequant_forward_bytes(spec, cp),
                             communication=comm.forward_gather_bytes(spec, plan, in_layer=True)))
        extra = quant.dequant_backward_extra_bytes(spec, cp)
        for ph in [p for p in phases if p.name.startswith("backward (layer") and "pre-backward" not in p.name]:
            b = dict(ph.breakdown)
            b[Category.TEMPORARIES] += extra
            phases.append(Phase(f"{ph.name}, {quant.bits(cp)} weight dequantized", b))
            held[phases[-1].name] = held.get(ph.name, 0)
    # The root's post-backward (final callback): its parameters are resharded before the reduce; of its unsharded
    # gradients the lm_head weight's is still referenced during the collective (seen in every run; the holder of
    # the reference is not pinned down), the others are freed after the copy-in.
    root_sharded = sum(local_numel(p, plan) for p in spec.outer_params) * plan.precision.param_bytes
    head = next((p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name), spec.outer_params[0])
    head_unsharded = local_numel(head, cp) * cp.precision.param_bytes
    if lora.is_lora(plan):  # the root's frozen weights have no gradients; its adapters' (if any) are sharded
        root_sharded, head_unsharded = lora.sharded_outer_adapter_bytes(spec, plan), 0
    phases.append(_phase("backward end (root reduce-scatter)", **persistent, logits=logits,
                         gradients=sum(sharded_layer) * resident + root_sharded + head_unsharded,
                         communication=comm.root_reduce_scatter_input_bytes(spec, plan)
                         + comm.shard_dim1_reduce_bytes(spec, plan, root=True)
                         + comm.reduce_scatter_scratch_bytes(spec, plan, root=True)))
    held["backward end (root reduce-scatter)"] = sum(sharded_layer) * resident
    if plan.grad_accum > 1:
        phases += fsdp_accumulation_phases(spec, plan, phases, held)
    phases.append(_phase("optimizer step", **persistent, gradients=gradient_bytes(spec, plan) * resident,
                         logits=logits, temporaries=optimizer_step_temporary_bytes(spec, plan) * resident))
    return phases


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
    dropout 0 the layer's backward peaks)."""
    if not (lora.half_adapters(plan) and plan.grad_ckpt is GradCkpt.FULL and plan.lora_dropout > 0):
        return None
    if not any("down_proj" in p.name for p in lora.targeted(spec, plan)):
        return None
    rb, tokens = cp.precision.compute_bytes, plan.batch_size * plan.seq_len
    scaling = sum(s.bytes for s in lora.layer_saved(spec, cp, half=True) if s.name.startswith("down_proj: scaling"))
    intermediates = tokens * (3 * spec.hidden_size + spec.intermediate_size) * rb
    live = intermediates + act.checkpoint_rng_state_bytes(cp) - scaling
    return live, tokens * spec.hidden_size * rb


def fsdp_accumulation_phases(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase],
                             held: dict[str, int]) -> list[Phase]:
    """FSDP2 with `--grad-accum K > 1` (no `set_requires_gradient_sync(False)`): every micro-step's backward
    reduce-scatters. After micro-step 1 each parameter's sharded `.grad` is a view of its group's reduce-scatter
    output, kept until zero_grad; in micro-steps 2..K `foreach_reduce` finds `sharded_param.grad` set and adds the new
    output into it in place (`grad._local_tensor += new_sharded_grad`), the new output freed when it returns. The
    unsharded gradients are handed to the reduce-scatter and dropped as in micro-step 1 (none is kept unsharded).
    So each moment of micro-step 2 is micro-step 1's with every sharded gradient alive, where the gradients
    micro-step 1 had there beyond the sharded ones it already held (`held`) are transient: the root's unsharded
    gradients, a layer's unsharded gradients before its copy-in, the new reduce-scatter output."""
    grads_all = gradient_bytes(spec, plan) * (0 if offload.is_offloaded(plan) else 1)
    out = []
    for ph in phases:
        if ph.name == "optimizer step":
            continue
        b = dict(ph.breakdown)
        b[Category.GRADIENTS] = grads_all + b[Category.GRADIENTS] - held.get(ph.name, 0)
        out.append(Phase(f"{ph.name}, sharded gradients alive (micro-step 2)", b))
    return out


def estimate(spec: ModelSpec, plan: TrainingPlan) -> Estimate:
    """The per-GPU peak of `plan` on `spec` (largest rank), its phase and breakdown."""
    validate_plan_for_model(spec, plan)
    phases = iteration_phases(spec, plan)
    peak = max(phases, key=lambda p: p.total)
    return Estimate(
        spec=spec,
        plan=plan,
        peak_phase=peak.name,
        breakdown=dict(peak.breakdown),
        phases=tuple(phases),
        cuda_context_bytes=outside.cuda_context_bytes(plan),
        fragmentation_bytes=outside.fragmentation_bytes(peak.total, plan),
        paged_state_bytes=paged_state_bytes(spec, plan),
        host_breakdown=offload.host_breakdown(spec, plan),
        host_pinned_bytes=offload.host_pinned_bytes(spec, plan),
    )


def validate_plan_for_model(spec: ModelSpec, plan: TrainingPlan) -> None:
    """Checks that need both: TP must divide the heads and the MLP width, and the family must have a TP plan."""
    from llmem.errors import InputError
    spec.family  # noqa: B018 - an architecture outside llmem.families is refused here, naming model_type
    lora.validate(spec, plan)
    lora.check_supported(spec, plan)
    if fused_ce.is_fused(plan) and spec.model_type not in fused_ce.LIGER_FAMILIES:
        raise InputError("loss", f"fused-linear-ce is modelled for the families {', '.join(fused_ce.LIGER_FAMILIES)} "
                         f"(Liger-Kernel patches them); {spec.model_type!r} is not one: use --loss standard")
    if plan.tp == 1:
        return
    if not spec.supports_tp:
        raise InputError("tp", f"tensor parallelism needs separate q/k/v/o and gate/up/down projections; "
                         f"{spec.model_type!r} has fused ones. Use --tp 1 (DDP or ZeRO) for this model")
    for name, value in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                        ("intermediate_size", spec.intermediate_size)):
        if value % plan.tp:
            raise InputError("tp", f"TP degree {plan.tp} must divide {name} = {value}; "
                             f"choose a divisor of {value}")
    if plan.scheme not in (Scheme.TP, Scheme.TP_ZERO3):
        raise InputError("tp", "internal: TP degree without a TP scheme")
