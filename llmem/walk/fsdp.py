"""The walk of FSDP2 (ZeRO-2/3, and TP x FSDP2): `single.py`'s moments with FSDP2's buffers (see
`llmem.components.communication`), in order — the forward's all-gathers, the end of forward, the loss and lm_head
(ZeRO-3: the root's pre-backward all-gather), each evaluated layer's backward and reduce-scatter
(`fsdp_layer.fsdp_layer_moments`), the root's reduce-scatter and the optimizer step. Gradients of the root stay
unsharded in param_dtype until the final callback; a layer's unsharded gradients exist from its backward to its
reduce-scatter. The compute is the single-device walk's of `compute_plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmem.components import Category, lora, offload, quant
from llmem.components import activations as act
from llmem.components import communication as comm
from llmem.components import logits as lg
from llmem.components.gradients import gradient_bytes, head_gradient_bytes, layer_gradient_bytes
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import parameter_bytes
from llmem.components.sharding import local_numel, shard_summary
from llmem.plan import GradCkpt, Offload, Precision, Scheme, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.accumulation import fsdp_accumulation_phases
from llmem.walk.phase import Phase, moment, with_extra


def compute_plan(plan: TrainingPlan) -> TrainingPlan:
    """The plan whose single-device walk matches one FSDP2 rank's compute: TP-local tensors, unsharded; under a
    MixedPrecisionPolicy the whole forward runs in the half dtype (no autocast), as pure half precision does."""
    precision = plan.precision
    if precision.is_mixed:
        precision = Precision.BF16 if precision is Precision.BF16_MIXED else Precision.FP16
    return plan.with_(gpus=plan.tp, zero=0, precision=precision, offload=Offload.NONE)


@dataclass(frozen=True)
class FsdpTerms:
    """What the moments of one FSDP2 plan's walk share (`cp`: the compute plan)."""

    spec: ModelSpec
    plan: TrainingPlan
    cp: TrainingPlan
    persistent: dict
    resident: int  # 0 with --offload optimizer+params: shards, gradients, states and step on the host
    kept: int
    outer_act: int
    forward_acts: int
    recompute: int
    first_saving: int  # LoRA: what layer 0 keeps less while its saves live
    half: bool  # LoRA under a MixedPrecisionPolicy: half adapters
    adapter_grad: int  # bytes per unsharded adapter gradient element
    partial: bool
    varied: bool  # layers of several kinds (`activations.varied`)
    kept_layers: Callable
    current_layer: Callable
    logits: int
    root_grads_head: int
    sharded_layer: list
    layer_grads: int
    residual_grad: int
    rs_in: int
    bwd_head: int
    root_gather: int
    layer_gather: int
    ids: int
    hidden: int

    @property
    def layers(self) -> int:
        return self.spec.num_layers


def _fsdp_activation_terms(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> dict:
    """The activations of the compute plan; LoRA (half adapters under a MixedPrecisionPolicy) as in `single.py`."""
    from functools import partial as partial_fn

    layers = spec.num_layers
    kept = act.kept_per_layer_bytes(spec, cp)
    outer_act = act.outer_saved_bytes(spec, cp)
    forward_acts = act.kept_layers_bytes(spec, cp, layers) + outer_act + act.final_norm_bytes(spec, cp)
    recompute = act.recompute_bytes(spec, cp) if plan.grad_ckpt is GradCkpt.FULL else 0
    first_saving = 0
    # LoRA under a MixedPrecisionPolicy: the adapters are all-gathered in the half dtype too and compute in it
    half = lora.half_adapters(plan)
    kept_layers, current_layer = act.kept_layers_bytes, act.current_layer_backward_bytes
    if lora.is_lora(plan):  # as in `iteration_phases`: the frozen base's saved tensors, the adapters' own
        if plan.grad_ckpt is GradCkpt.FULL:
            # the checkpoint's own copy of the layer input, which in half precision no op of the layer saves
            recompute = lora.recompute_bytes(spec, cp, half)
        else:
            kept = lora.layer_activation_bytes(spec, cp, half=half)
            first_saving = lora.first_layer_saving_bytes(spec, cp, half)  # layer 0 keeps less while its saves live
        forward_acts = lora.kept_layers_bytes(spec, cp, layers, half=half) - first_saving + outer_act \
            + lora.final_norm_bytes(spec, cp)
        kept_layers = partial_fn(lora.kept_layers_bytes, half=half)
        current_layer = partial_fn(lora.current_layer_backward_bytes, half=half)
    ids = sum(s.bytes for s in act.outer_saved(spec, cp) if s.name.startswith("input_ids"))
    return dict(kept=kept, outer_act=outer_act, forward_acts=forward_acts, recompute=recompute,
                first_saving=first_saving, half=half, kept_layers=kept_layers, current_layer=current_layer,
                partial=plan.grad_ckpt is GradCkpt.FULL and plan.ckpt_every > 1, varied=act.varied(spec, cp), ids=ids,
                hidden=act.checkpointed_layer_bytes(spec, cp))  # the hidden states entering a layer


def _fsdp_gradient_terms(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> dict:
    """Gradients (the root's and a layer's unsharded in param_dtype, the layers' shards) and FSDP2's buffers."""
    half = lora.half_adapters(plan)
    adapter_grad = cp.precision.compute_bytes if half else lora.ADAPTER_BYTES  # unsharded adapter gradients
    pb = plan.precision.param_bytes
    sharded_layer = [n * pb for n in shard_summary(spec, plan).per_layer]
    layer_grads = layer_gradient_bytes(spec, cp, 0)  # unsharded, param_dtype
    if lora.is_lora(plan):  # only the adapters have gradients
        sharded_layer = lora.sharded_layer_adapter_bytes(spec, plan)
        layer_grads = lora.layer_adapter_bytes(spec, cp, 0, adapter_grad)
    return dict(
        adapter_grad=adapter_grad, logits=lg.logits_bytes(spec, cp),
        root_grads_head=head_gradient_bytes(spec, cp),  # unsharded, param_dtype
        sharded_layer=sharded_layer, layer_grads=layer_grads,
        residual_grad=plan.batch_size * plan.seq_len * spec.hidden_size * cp.precision.param_bytes,  # d(output)
        rs_in=comm.layer_reduce_scatter_input_bytes(spec, plan), bwd_head=comm.backward_gather_bytes(spec, plan, None),
        root_gather=comm.root_unsharded_bytes(spec, plan), layer_gather=comm.layer_unsharded_bytes(spec, plan))


def fsdp_terms(spec: ModelSpec, plan: TrainingPlan) -> FsdpTerms:
    cp = compute_plan(plan)
    # --offload optimizer+params: sharded parameters, sharded gradients, optimizer states and the step live on the
    # host (`llmem.components.offload`); a reduce-scatter output is on the GPU only until its copy to the host.
    resident = 0 if offload.is_offloaded(plan) else 1
    persistent = dict(parameters=parameter_bytes(spec, plan) * resident,
                      optimizer=optimizer_state_bytes(spec, plan) * resident)
    return FsdpTerms(spec=spec, plan=plan, cp=cp, persistent=persistent, resident=resident,
                     **_fsdp_activation_terms(spec, plan, cp), **_fsdp_gradient_terms(spec, plan, cp))


def forward_gather_moments(w: FsdpTerms) -> list[Phase]:
    """The start of forward: the root's pre-forward all-gather (the step's input_ids alive), its copy-out (the output
    beside the new unsharded storage); then, with the embeddings' output (layer 0's input) alive, layer 0's
    all-gather and copy-out while the root's output is still retained (`all_gather_state`) beside the root's
    unsharded parameters. Each copy-out frees the retained output only when it returns (`wait_for_unshard` holds
    it in a local), so later forward all-gathers and copy-outs hold one retained layer output: the last layer's
    are the largest (`last_layer_gather_moments`)."""
    spec, plan, rg = w.spec, w.plan, w.root_gather
    start, layer0 = dict(**w.persistent, activations=w.ids), dict(**w.persistent, activations=w.outer_act + w.hidden)
    return [
        moment("forward (root all-gather)", **start, communication=comm.all_gather_bytes(spec, plan, root=True)),
        moment("forward (root all-gather copy-out)", **start,
               communication=2 * rg + comm.shard_dim1_copy_out_bytes(spec, plan, root=True)),
        moment("forward (layer 0 all-gather)", **layer0, communication=2 * rg + comm.all_gather_bytes(spec, plan)),
        moment("forward (layer 0 all-gather copy-out)", **layer0,
               communication=2 * rg + 2 * w.layer_gather + comm.shard_dim1_copy_out_bytes(spec, plan)),
    ] + last_layer_gather_moments(w)


def last_layer_gather_moments(w: FsdpTerms) -> list[Phase]:
    """The last layer's forward all-gather and copy-out (ZeRO-2 keeps every earlier layer gathered, ZeRO-3 only the
    activations grow); its copy-out: `wait_for_unshard` binds the retained output of layer L-2 to a local
    (`prev_all_gather_state`), so it is freed only when the copy-out returns."""
    spec, plan, cp, layers = w.spec, w.plan, w.cp, w.layers
    if layers <= 1:
        return []
    earlier_layers = (layers - 1) * w.kept - w.first_saving if lora.is_lora(plan) else act.kept_layers_bytes(
        spec, cp, layers - 1)
    unsharded = (layers - 1) * w.layer_gather if plan.scheme is Scheme.ZERO2 else 0
    # the model's forward holds the embeddings' output (`inputs_embeds`) through its layer loop: extra where no
    # op of layer 0 saves it (LoRA: layer 0's input needs no grad; a half-precision RMSNorm saves its fp32 copy)
    embeds = 0
    if plan.grad_ckpt is not GradCkpt.FULL and (lora.is_lora(plan) or not any(
            s.name.startswith("input (residual stream") for s in act.layer_saved(spec, cp))):
        embeds = w.hidden
    on = dict(**w.persistent, activations=earlier_layers + w.outer_act + embeds + w.hidden)
    return [
        moment(f"forward (layer {layers - 1} all-gather)", **on,
               communication=w.root_gather + unsharded + w.layer_gather + comm.all_gather_bytes(spec, plan)),
        moment(f"forward (layer {layers - 1} all-gather copy-out)", **on,
               communication=w.root_gather + unsharded + 3 * w.layer_gather
               + comm.shard_dim1_copy_out_bytes(spec, plan)),
    ]


def head_moments(w: FsdpTerms) -> list[Phase]:
    """The end of forward, the loss's forward and backward, the lm_head's backward; ZeRO-3 inserts the root's
    pre-backward moments after the loss forward (`root_prebackward_moments`)."""
    spec, plan, cp = w.spec, w.plan, w.cp
    on = dict(**w.persistent, activations=w.forward_acts)
    phases = [
        moment("forward (last layer)", **on, communication=comm.forward_gather_bytes(spec, plan, in_layer=True)),
        moment("loss forward", **on, logits=lg.loss_forward_peak_bytes(spec, cp),
               communication=comm.forward_gather_bytes(spec, plan, in_layer=False)),
    ]
    phases += root_prebackward_moments(w)
    return phases + [
        moment("loss backward", **on, logits=lg.loss_backward_peak_bytes(spec, cp), communication=w.bwd_head),
        moment("lm_head backward", **on, gradients=w.root_grads_head, logits=lg.lm_head_backward_bytes(spec, cp),
               communication=w.bwd_head),
    ]


def root_prebackward_moments(w: FsdpTerms) -> list[Phase]:
    """ZeRO-3: the root's pre-backward (a hook on the loss, before its backward) all-gathers the root again, copies
    it out, and prefetches the last layer (`_backward_prefetch`); the forward's saved tensors and the loss's are
    alive, the last layer's retained output was freed by the root's post-forward."""
    spec, plan = w.spec, w.plan
    if not comm.root_resharded_after_forward(plan):
        return []
    at_start = dict(**w.persistent, activations=w.forward_acts, logits=lg.loss_backward_start_bytes(spec, w.cp))
    return [
        moment("loss backward (root pre-backward all-gather)", **at_start,
               communication=comm.all_gather_bytes(spec, plan, root=True)),
        moment("loss backward (root pre-backward copy-out)", **at_start,
               communication=2 * w.root_gather + comm.shard_dim1_copy_out_bytes(spec, plan, root=True)),
        moment(f"loss backward (prefetch of layer {w.layers - 1})", **at_start,
               communication=w.root_gather + comm.all_gather_bytes(spec, plan)),
    ]


def qlora_moments(w: FsdpTerms, phases: list[Phase], held: dict[str, int]) -> list[Phase]:
    """QLoRA: a 4-bit Linear's dequantized weight (`quant.py`: the gathered codes + quant_state) on top of the
    forward and the layer-backward moments."""
    spec, plan, cp = w.spec, w.plan, w.cp
    if not quant.is_qlora(plan):
        return []
    out = [moment(f"forward (last layer), {quant.forward_moment_label(cp)}", **w.persistent,
                  activations=w.forward_acts, temporaries=quant.dequant_forward_bytes(spec, cp),
                  communication=comm.forward_gather_bytes(spec, plan, in_layer=True))]
    extra = quant.dequant_backward_extra_bytes(spec, cp)
    for ph in [p for p in phases if p.name.startswith("backward (layer") and "pre-backward" not in p.name]:
        out.append(with_extra(ph, f"{ph.name}, {quant.bits(cp)} weight dequantized", Category.TEMPORARIES, extra))
        held[out[-1].name] = held.get(ph.name, 0)
    return out


def root_reduce_moment(w: FsdpTerms, held: dict[str, int]) -> Phase:
    """The root's post-backward (final callback): its parameters are resharded before the reduce; of its unsharded
    gradients the lm_head weight's is still referenced during the collective (seen in every run; the holder of the
    reference is not pinned down), the others are freed after the copy-in."""
    spec, plan, cp = w.spec, w.plan, w.cp
    root_sharded = sum(local_numel(p, plan) for p in spec.outer_params) * plan.precision.param_bytes
    head = next((p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name), spec.outer_params[0])
    head_unsharded = local_numel(head, cp) * cp.precision.param_bytes
    if lora.is_lora(plan):  # the root's frozen weights have no gradients; its adapters' (if any) are sharded
        root_sharded, head_unsharded = lora.sharded_outer_adapter_bytes(spec, plan), 0
    held["backward end (root reduce-scatter)"] = sum(w.sharded_layer) * w.resident
    return moment("backward end (root reduce-scatter)", **w.persistent, logits=w.logits,
                  gradients=sum(w.sharded_layer) * w.resident + root_sharded + head_unsharded,
                  communication=comm.root_reduce_scatter_input_bytes(spec, plan)
                  + comm.shard_dim1_reduce_bytes(spec, plan, root=True)
                  + comm.reduce_scatter_scratch_bytes(spec, plan, root=True))


def fsdp_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """FSDP2 (ZeRO-2/3, and TP x FSDP2): the candidate peak moments of one steady-state iteration on one rank."""
    from llmem.walk.fsdp_layer import fsdp_layer_moments

    w = fsdp_terms(spec, plan)
    phases = forward_gather_moments(w) + head_moments(w)
    held: dict[str, int] = {}  # phase -> the sharded gradients micro-step 1 already holds there (for --grad-accum)
    # Live bytes are linear in the layer index between the edges (prefetch only for l > 0, a retained
    # reduce_scatter_input only for l < L-1), so the extremes are among the two outermost layers at each end.
    # With --ckpt-every K > 1 the same holds within each residue class mod K (`activations.backward_layers`).
    for layer in act.backward_layers(spec, w.cp, edge=2):  # (the compute plan's fits: `activations.varied`)
        phases += fsdp_layer_moments(w, layer, held)
    phases += qlora_moments(w, phases, held)
    phases.append(root_reduce_moment(w, held))
    if plan.grad_accum > 1:
        phases += fsdp_accumulation_phases(spec, plan, phases, held)
    phases.append(moment("optimizer step", **w.persistent, gradients=gradient_bytes(spec, plan) * w.resident,
                         logits=w.logits, temporaries=optimizer_step_temporary_bytes(spec, plan) * w.resident))
    return phases
