"""The walk of FSDP2 (ZeRO-2/3, and TP x FSDP2): `single.py`'s moments with FSDP2's buffers (see
`llmem.components.communication`), in order — the forward's all-gathers, the end of forward, the loss and lm_head
(ZeRO-3: the root's pre-backward all-gather), each evaluated layer's backward and reduce-scatter
(`fsdp_layer.fsdp_layer_moments`), the embedding's backward, the root's reduce-scatter and the optimizer step.
Gradients of the root stay unsharded in param_dtype until the final callback; a layer's unsharded gradients exist
from its backward to its reduce-scatter. The compute is the single-device walk's of `compute_plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from llmem.components import (
    Category,
    act_offload,
    chunked_ce,
    lora,
    lora_forward,
    moe_forward,
    no_sync,
    offload,
    quant,
    returned_probs,
)
from llmem.components import activations as act
from llmem.components import attention_core as core
from llmem.components import communication as comm
from llmem.components import logits as lg
from llmem.components import norm_backward as norm_bwd
from llmem.components.gradients import (
    embedding_gradient_accumulate_bytes,
    embedding_input_gradient_bytes,
    gradient_bytes,
    head_gradient_bytes,
    layer_gradient_bytes,
    tied_gradient_sum_bytes,
)
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import buffer_bytes, parameter_bytes
from llmem.components.sharding import local_numel, shard_summary
from llmem.memo import remembered
from llmem.plan import Engine, GradCkpt, Offload, TrainingPlan
from llmem.spec import ModelSpec, per_spec
from llmem.walk.accumulation import fsdp_accumulation_phases, gradients_kept
from llmem.walk.chunked import fsdp_head_moments
from llmem.walk.final_norm import norm_moment
from llmem.walk.no_sync import fsdp_no_sync_phases
from llmem.walk.phase import Phase, moment, with_extra


def compute_plan(plan: TrainingPlan) -> TrainingPlan:
    """The plan whose single-device walk matches one FSDP2 rank's compute: TP-local tensors, unsharded; under a
    MixedPrecisionPolicy the whole forward runs in the half dtype (no autocast), as pure half precision does."""
    return remembered(_COMPUTE_PLANS, plan.key, lambda: plan.with_(
        gpus=plan.tp, zero=0, precision=plan.precision.pure, offload=Offload.NONE, engine=Engine.TORCH), 1024)


_COMPUTE_PLANS: dict = {}  # plan key -> compute plan (a plan is immutable; at most 1,024 kept)


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
    sharded_layer: tuple
    sharded_later: tuple  # sharded_later[l]: the shards of the layers after l
    sharded_total: int
    # per decoder layer, each at its own size (DeepSeek's dense first layers, Qwen3-MoE's dense layers are smaller):
    reduce_extras: tuple  # its reduce-scatter: the last Shard(1) gradient's original (`shard_dim1_reduce_bytes`)
    copy_in_extras: tuple  # ... its copy-in's padded copies (`chunk_cat_padding_bytes`)
    rs_scratches: tuple  # ... and gloo's scratch (`reduce_scatter_scratch_bytes`)
    lora: bool
    core: bool  # the layers' moments: the eager attention core's (`attention_core.applies`)
    core_grads: int  # ... with the weight gradients made before it
    post_norm: bool  # gemma2's post-feedforward norm's (full fine-tuning)
    post_norm_bwd: int  # ... with its backward's temporaries
    falcon_math: bool  # falcon's math-path attention core's
    recompute_end: tuple | None  # `fsdp_layer.lora_recompute_end`
    layer_grads: tuple  # each layer's unsharded gradients
    residual_grad: int
    rs_ins: tuple  # each layer's reduce_scatter_input (`communication.layer_reduce_scatter_input_bytes`)
    root_all_gather: int  # inside the root's / each layer's all-gather (`communication.all_gather_bytes`)
    layer_all_gathers: tuple
    root_copy_out: int  # the Shard(1) temporaries of the root's / each layer's copy-out (`shard_dim1_copy_out_bytes`)
    layer_copy_outs: tuple
    end_in_layer: int  # at the end of forward, in the last layer and at the loss (`forward_gather_bytes`)
    end_at_loss: int
    bwd_head: int
    root_gather: int
    layer_gathers: tuple  # each layer's unsharded parameters (`communication.layer_unsharded_bytes`)
    ids: int
    hidden: int

    @property
    def layers(self) -> int:
        return self.spec.num_layers


@per_spec()
def _fsdp_activation_terms(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """The activations of the compute plan; LoRA (half adapters under a MixedPrecisionPolicy) as in `single.py`."""
    cp = compute_plan(plan)
    from functools import partial as partial_fn

    layers = spec.num_layers
    kept = act.kept_per_layer_bytes(spec, cp)
    outer_act = act.outer_saved_bytes(spec, cp)
    forward_acts = act.kept_layers_bytes(spec, cp, layers) + outer_act + act.final_norm_bytes(spec, cp)
    recompute = act.recompute_bytes(spec, cp) if act.checkpoints_layers(plan) else 0
    first_saving = 0
    # LoRA under a MixedPrecisionPolicy: the adapters are all-gathered in the half dtype too and compute in it
    half = lora.half_adapters(plan)
    kept_layers, current_layer = act.kept_layers_bytes, act.current_layer_backward_bytes
    # as in `iteration_phases`: the frozen base's saved tensors, the adapters' own (traced LoRA: the derived tables)
    if lora.is_lora(plan) and spec.derived is None:
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
    if act_offload.applies(plan):  # as in `single.iteration_terms`: the layers' inputs are on the host
        forward_acts, kept_layers = outer_act + act.final_norm_bytes(spec, cp), act_offload.layers_below_bytes
    ids = sum(s.bytes for s in act.outer_saved(spec, cp) if s.name.startswith("input_ids"))
    partial = plan.grad_ckpt is GradCkpt.FULL and plan.ckpt_every > 1
    from llmem.walk.fsdp_layer import lora_recompute_end
    return dict(kept=kept, outer_act=outer_act, forward_acts=forward_acts, recompute=recompute,
                first_saving=first_saving, half=half, kept_layers=kept_layers, current_layer=current_layer,
                partial=partial, varied=act.varied(spec, cp), ids=ids,
                recompute_end=None if partial else lora_recompute_end(spec, plan, cp),
                hidden=act.checkpointed_layer_bytes(spec, cp),  # the hidden states entering a layer
                post_norm_bwd=norm_bwd.post_mlp_norm_backward_bytes(spec, cp))


def _fsdp_gradient_terms(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> dict:
    """Gradients (the root's and a layer's unsharded in param_dtype, the layers' shards) and FSDP2's buffers."""
    return dict(**_fsdp_layout_terms(spec, plan), logits=lg.logits_bytes(spec, cp),
                residual_grad=plan.batch_size * plan.seq_len * spec.hidden_size * cp.precision.param_bytes)  # d(output)


@per_spec("layout_key")
def _fsdp_layout_terms(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """The gradient and buffer terms that do not depend on the micro-batch or the sequence length; `sharded_later[l]`
    is the layers' shards after layer l (suffix sums of `sharded_layer`)."""
    cp = compute_plan(plan)
    half = lora.half_adapters(plan)
    adapter_grad = cp.precision.compute_bytes if half else lora.adapter_elem_bytes(spec)  # unsharded adapter gradients
    pb = plan.precision.param_bytes
    sharded_layer = [n * pb for n in shard_summary(spec, plan).per_layer]
    layers = range(spec.num_layers)
    layer_grads = tuple(layer_gradient_bytes(spec, cp, k) for k in layers)  # unsharded, param_dtype
    if lora.is_lora(plan):  # only the adapters have gradients
        sharded_layer = lora.sharded_layer_adapter_bytes(spec, plan)
        layer_grads = tuple(lora.layer_adapter_bytes(spec, cp, k, adapter_grad) for k in layers)
    later = [0] * len(sharded_layer)
    for layer in range(len(sharded_layer) - 2, -1, -1):
        later[layer] = later[layer + 1] + sharded_layer[layer + 1]
    return dict(
        adapter_grad=adapter_grad, root_grads_head=head_gradient_bytes(spec, cp),  # unsharded, param_dtype
        sharded_layer=tuple(sharded_layer), sharded_later=tuple(later), sharded_total=sum(sharded_layer),
        layer_grads=layer_grads, reduce_extras=tuple(comm.shard_dim1_reduce_bytes(spec, plan, layer=k) for k in layers),
        copy_in_extras=tuple(comm.chunk_cat_padding_bytes(spec, plan, layer=k) for k in layers),
        rs_scratches=tuple(comm.reduce_scatter_scratch_bytes(spec, plan, layer=k) for k in layers),
        lora=lora.is_lora(plan),
        core=core.applies(spec, plan), post_norm=norm_bwd.applies(spec) and not lora.is_lora(plan),
        core_grads=core.eager_core_layer_gradient_bytes(spec, cp, adapter_grad),
        falcon_math=act.falcon_math_attention(spec, plan) and not lora.is_lora(plan),  # (as the one-GPU walk)
        root_all_gather=comm.all_gather_bytes(spec, plan, root=True),
        layer_all_gathers=tuple(comm.all_gather_bytes(spec, plan, layer=k) for k in layers),
        root_copy_out=comm.shard_dim1_copy_out_bytes(spec, plan, root=True),
        layer_copy_outs=tuple(comm.shard_dim1_copy_out_bytes(spec, plan, layer=k) for k in layers),
        end_in_layer=comm.forward_gather_bytes(spec, plan, in_layer=True),
        end_at_loss=comm.forward_gather_bytes(spec, plan, in_layer=False),
        rs_ins=comm.layers_reduce_scatter_input_bytes(spec, plan),
        bwd_head=comm.backward_gather_bytes(spec, plan, None),
        root_gather=comm.root_unsharded_bytes(spec, plan), layer_gathers=comm.layers_unsharded_bytes(spec, plan))


def fsdp_terms(spec: ModelSpec, plan: TrainingPlan) -> FsdpTerms:
    cp = compute_plan(plan)
    # --offload optimizer+params: sharded parameters, sharded gradients, optimizer states and the step live on the
    # host (`llmem.components.offload`), the buffers stay on the GPU; a reduce-scatter output is on the GPU only
    # until its copy to the host.
    resident = 0 if offload.is_offloaded(plan) else 1
    persistent = dict(parameters=parameter_bytes(spec, plan) if resident else buffer_bytes(spec, plan),
                      optimizer=optimizer_state_bytes(spec, plan) * resident)
    return FsdpTerms(spec=spec, plan=plan, cp=cp, persistent=persistent, resident=resident,
                     **_fsdp_activation_terms(spec, plan), **_fsdp_gradient_terms(spec, plan, cp))


def head_moments(w: FsdpTerms) -> list[Phase]:
    """The end of forward, the loss's forward and backward, the lm_head's backward; ZeRO-3 inserts the root's
    pre-backward moments after the loss forward (`root_prebackward_moments`)."""
    spec, cp = w.spec, w.cp
    if chunked_ce.is_chunked(cp) or act_offload.applies(cp):  # the loss after the model's forward
        return fsdp_head_moments(w)
    on = dict(**w.persistent, activations=w.forward_acts)
    norm = moe_forward.final_norm_forward_extra_bytes(spec, cp)  # inside the final norm's forward
    moe = moe_forward.forward_extra_bytes(spec, cp, w.half)  # inside the last layer's routed experts (still gathered)
    down = lora_forward.down_proj_forward_extra_bytes(spec, cp)  # inside its down_proj's adapter (`lora_forward`)
    phases = [
        moment("forward (last layer)", **on, communication=w.end_in_layer),
        *([moment("forward (last layer, MoE experts)", **dict(on, activations=w.forward_acts + moe),
                  communication=w.end_in_layer)] if moe else []),
        *([moment("forward (last layer), down_proj LoRA", **dict(on, activations=w.forward_acts + down),
                  communication=w.end_in_layer)] if down else []),
        *([moment("final norm forward", **dict(on, activations=w.forward_acts + norm),  # (last layer resharded)
                  communication=w.end_at_loss)] if norm else []),
        moment("loss forward", **on, logits=lg.loss_forward_peak_bytes(spec, cp), communication=w.end_at_loss),
    ]
    from llmem.walk.single import PROBS_MOMENT, forward_inflight_bytes  # (0 for a checkpointed last layer)

    final_norm = act.final_norm_bytes(spec, cp)  # the decoder's locals, GPT-NeoX's parallel add, BLOOM's attention
    for name, extra in (("forward (last layer, in flight)", forward_inflight_bytes(spec, cp, final_norm)),  # add;
                        (PROBS_MOMENT, returned_probs.forward_extra_bytes(spec, cp, final_norm))):  # a checkpointed
        if extra:  # last layer's softmax beside the previous layer's returned probabilities (`returned_probs`)
            phases.insert(1, moment(name, **dict(on, activations=w.forward_acts + extra), communication=w.end_in_layer))
    phases += root_prebackward_moments(w)
    return phases + [
        moment("loss backward", **on, logits=lg.loss_backward_peak_bytes(spec, cp), communication=w.bwd_head),
        moment("lm_head backward", **on, gradients=w.root_grads_head, logits=lg.lm_head_backward_bytes(spec, cp),
               communication=w.bwd_head),
    ]


def root_prebackward_moments(w: FsdpTerms, logits: int | None = None) -> list[Phase]:
    """ZeRO-3: the root's pre-backward (a hook on the loss, before its backward) all-gathers the root again, copies
    it out, and prefetches the last layer (`_backward_prefetch`); the forward's saved tensors and the loss's are
    alive (`logits`, by default the loss's at the start of backward), the last layer's retained output was freed by
    the root's post-forward."""
    spec, plan = w.spec, w.plan
    if not comm.root_resharded_after_forward(plan):
        return []
    logits = lg.loss_backward_start_bytes(spec, w.cp) if logits is None else logits
    at_start = dict(**w.persistent, activations=w.forward_acts, logits=logits)
    return [
        moment("loss backward (root pre-backward all-gather)", **at_start, communication=w.root_all_gather),
        moment("loss backward (root pre-backward copy-out)", **at_start,
               communication=2 * w.root_gather + w.root_copy_out),
        moment(f"loss backward (prefetch of layer {w.layers - 1})", **at_start,
               communication=w.root_gather + w.layer_all_gathers[-1]),
    ]


def qlora_moments(w: FsdpTerms, phases: list[Phase], held: dict[str, int]) -> list[Phase]:
    """QLoRA: a 4-bit Linear's dequantized weight (`quant.py`: the gathered codes + quant_state) on top of the
    forward and the layer-backward moments."""
    spec, plan, cp = w.spec, w.plan, w.cp
    if not quant.is_qlora(plan):
        return []
    out = [moment(f"forward (last layer), {quant.forward_moment_label(cp)}", **w.persistent,
                  activations=w.forward_acts, temporaries=quant.dequant_forward_bytes(spec, cp),
                  communication=w.end_in_layer)]
    extra = quant.dequant_backward_extra_bytes(spec, cp)
    for ph in [p for p in phases if p.name.startswith("backward (layer") and "pre-backward" not in p.name]:
        out.append(with_extra(ph, f"{ph.name}, {quant.bits(cp)} weight dequantized", Category.TEMPORARIES, extra))
        held[out[-1].name] = held.get(ph.name, 0)
    return out


def embedding_backward_moments(w: FsdpTerms, held: dict[str, int]) -> list[Phase]:
    """The end of backward before the root's post-backward (`single.end_moments` on the compute plan): the
    embedding's dense gradient made (tied: beside the lm_head's, waiting in the shared weight's InputBuffer) with its
    input gradient alive, then with tied embeddings their out-of-place sum (`gradients.tied_gradient_sum_bytes`: FSDP2
    runs no autocast, so the lm_head's half gradient is `mm(...).t()`'s view), once the input gradient is freed. Every
    layer's gradient is sharded by now; the root is still gathered (`comm.backward_gather_bytes`), and layer 0's
    reduce_scatter_input waits in `comm_ctx.reduce_scatter_states` for the root's post-backward
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: `post_backward`). LoRA: the frozen embedding runs
    no backward; a trained copy of it does (`fsdp_root.embedding_copy_backward_moments`)."""
    spec, plan, cp = w.spec, w.plan, w.cp
    if lora.is_lora(plan):  # only a trained embedding copy runs backward
        return embedding_copy_backward_moments(w, held)
    root_grads = sum(local_numel(p, cp) for p in spec.outer_params) * cp.precision.param_bytes  # unsharded
    end = dict(**w.persistent, logits=w.logits, gradients=sum(w.sharded_layer) * w.resident + root_grads,
               communication=comm.backward_gather_bytes(spec, plan, 0, own=False) + w.rs_ins[0])
    accumulate = embedding_gradient_accumulate_bytes(spec, cp)
    phases = [moment("backward end", **end, temporaries=accumulate + embedding_input_gradient_bytes(spec, cp))]
    tied_sum = tied_gradient_sum_bytes(spec, cp)
    if tied_sum:
        phases.append(moment("backward end, tied gradients summed", **end, temporaries=accumulate + tied_sum))
    held |= {ph.name: sum(w.sharded_layer) * w.resident for ph in phases}
    return phases


def fsdp_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """FSDP2 (ZeRO-2/3, and TP x FSDP2): the candidate peak moments of one steady-state iteration on one rank."""
    from llmem.walk.fsdp_layer import fsdp_layer_moments

    if spec.derived is not None and lora.half_adapters(plan):  # traced LoRA: the tables of half adapters
        derived = spec.derived
        spec = spec.memo(("half adapters",), lambda: replace(spec, derived=derived.with_half_adapters()))
    w = fsdp_terms(spec, plan)
    phases = forward_gather_moments(w) + head_moments(w) + norm_moment(
        spec, w.cp, w.persistent, w.forward_acts, w.root_grads_head, w.logits, w.bwd_head)
    held: dict[str, int] = {}  # phase -> the sharded gradients micro-step 1 already holds there (for --grad-accum)
    # Live bytes are linear in the layer index between the edges (prefetch only for l > 0, a retained
    # reduce_scatter_input only for l < L-1), so the extremes are among the two outermost layers at each end.
    # With --ckpt-every K > 1 the same holds within each residue class mod K (`activations.backward_layers`).
    for layer in act.backward_layers(spec, w.cp, edge=2):  # (the compute plan's fits: `activations.varied`)
        phases += fsdp_layer_moments(w, layer, held)
    phases += qlora_moments(w, phases, held)
    phases += embedding_backward_moments(w, held)
    phases += [root_copy_in_moment(w, held), root_reduce_moment(w, held)]
    if no_sync.applies(plan):  # --no-sync: unsharded gradients accumulated, reduce-scattered in the last micro-step
        phases += fsdp_no_sync_phases(w, phases, held)
    elif gradients_kept(plan):
        phases += fsdp_accumulation_phases(spec, plan, phases, held)
    phases.append(moment("optimizer step", **w.persistent, gradients=gradient_bytes(spec, plan) * w.resident,
                         logits=w.logits, temporaries=optimizer_step_temporary_bytes(spec, plan) * w.resident))
    return phases


# the forward's all-gathers and the root's post-backward (modules of their own; read through this one)
from llmem.walk.fsdp_forward import forward_gather_moments, layer_gather_moments  # noqa: E402, F401
from llmem.walk.fsdp_root import (  # noqa: E402
    embedding_copy_backward_moments,
    root_copy_in_moment,
    root_reduce_moment,
)
