"""Gradients held on one rank once backward has produced them.

bytes = local_params * param_bytes: `.grad` has the parameter's dtype (fp32 under mixed precision: autocast's cast
backward returns fp32). FSDP2 keeps only the reduce-scattered shard; DDP and ZeRO-1 keep full gradients.
Gradients of decoder layer l exist from the backward of layer l on (`zero_grad(set_to_none=True)` frees them). Which
tensors get `.grad`s, and where backward makes them, is the method's inventory (`llmem.components.trainable`: LoRA
trains only its fp32 adapters, and the frozen embeddings run no backward); the terms here read it.
`--offload optimizer` without accumulation (torchao `offload_gradients=True`): a gradient of 4096+ elements is dropped
by its hook right after AccumulateGrad made it (`llmem.components.offload`; counted where made, `offloaded_*`)."""

from llmem.components import chunked_ce, lora, lora_moe, offload
from llmem.components.sharding import local_numel
from llmem.components.trainable import trainable
from llmem.plan import Scheme, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def in_buckets(plan: TrainingPlan) -> bool:
    """`--ddp-bucket-view`: `DistributedDataParallel(gradient_as_bucket_view=True)` makes each `.grad` a view into
    the Reducer's gradient bucket (`Reducer::mark_variable_ready_dense`, torch/csrc/distributed/c10d/reducer.cpp,
    copies a freshly made gradient into its bucket view and points `.grad` at the view), so a gradient costs no
    bytes of its own once its hook has run: the buckets (`communication.ddp_bucket_bytes`, standing) hold them all.
    Only DDP and ZeRO-1 build a Reducer."""
    return plan.ddp_bucket_view and plan.scheme in (Scheme.DDP, Scheme.ZERO1)


def freed_at_hook(plan: TrainingPlan) -> bool:
    """Whether a gradient has no bytes of its own once its AccumulateGrad and hooks ran: `--ddp-bucket-view`
    (copied into its bucket view, `in_buckets`) or `--optimizer-in-backward` (its own optimizer steps it and sets
    `.grad` to None in the post-accumulate-grad hook, `llmem.runtime.optim.InBackward`). The gradient terms treat the
    two alike: only a gradient not yet through its hook counts — the one just made, a tied lm_head's waiting in the
    InputBuffer (`bucket_view_pending_bytes`)."""
    return in_buckets(plan) or plan.optimizer_in_backward


@per_spec("layout_key")
def bucket_view_pending_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`--ddp-bucket-view` with tied embeddings: the shared weight's AccumulateGrad (and so its bucket hook) runs
    once both of its gradients are in the engine's InputBuffer, so the lm_head's waits there, a tensor of its own,
    from the lm_head's backward to the end of backward."""
    return trainable(spec, plan).shared


@per_spec("layout_key")
def backward_end_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Gradients alive when the embedding's is made: every `.grad` (`gradient_bytes`); with `--ddp-bucket-view`
    only the ones not yet copied into their bucket — the embedding's (and GPT-2's position embedding's) just made,
    or, tied, the lm_head's still pending (the embedding's is `embedding_gradient_accumulate_bytes` then); LoRA: a
    trainable embedding copy's, just made (`lora.copy_bytes`, 0 without one)."""
    if not freed_at_hook(plan):
        return gradient_bytes(spec, plan)
    t = trainable(spec, plan)
    return t.shared or t.embedding + t.positional


@per_spec("layout_key")
def gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Every `.grad` once backward is done (`trainable.Trainable.gradients`)."""
    return 0 if freed_at_hook(plan) else trainable(spec, plan).gradients


@per_spec("layout_key")
def layer_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    return trainable(spec, plan).layer[layer]


@per_spec("layout_key")
def later_layers_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Gradients of the layers after `layer`, which backward has already produced."""
    return 0 if freed_at_hook(plan) else trainable(spec, plan).later[layer]


@per_spec("layout_key")
def head_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Gradients that exist once the lm_head and final norm have run backward: every tensor outside the decoder
    layers except the input embeddings (whose gradient comes last) — unless tied, then the shared weight's.
    LoRA: the adapters outside the decoder layers (none with all-linear on llama-like models) and a trainable
    lm_head copy's (`--lora-modules-to-save lm_head`)."""
    if freed_at_hook(plan):
        return bucket_view_pending_bytes(spec, plan)
    return trainable(spec, plan).head


def head_held_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The part of `head_gradient_bytes` that is a `.grad` from the lm_head's backward on — all of it but a tied
    shared weight's lm_head gradient, which waits in the engine's InputBuffer for the embedding's until the end of
    backward (torch/csrc/autograd/input_buffer.cpp; `bucket_view_pending_bytes` is the same tensor). With
    `--grad-accum`, micro-step 2's AccumulateGrad adds each new head gradient into its `.grad` in place and frees it
    (`variable_grad += new_grad`, torch/csrc/autograd/functions/accumulate_grad.h), so during the layers' backward
    only these `.grad`s are held, not a second copy."""
    return max(head_gradient_bytes(spec, plan) - trainable(spec, plan).shared, 0)


@per_spec("layout_key")
def offloaded_head_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`--offload optimizer` with offloaded gradients: at the lm_head backward moment its (untied) weight gradient
    exists from AccumulateGrad until its hook drops it — counted there, not held afterwards."""
    if not offload.offloads_gradients(plan) or spec.tie_word_embeddings:
        return 0
    head = [p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name]
    return sum(local_numel(p, plan) for p in head if not offload.stays_on_device(local_numel(p, plan))) \
        * plan.precision.param_bytes


@per_spec("layout_key")
def offloaded_embedding_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`--offload optimizer` with offloaded gradients, at the end of backward: the embedding's gradient (tied: the
    shared weight's, summed with the lm_head's) exists until its hook drops it."""
    if not offload.offloads_gradients(plan):
        return 0
    return local_numel(spec.outer_params[0], plan) * plan.precision.param_bytes


def traced_experts(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Full fine-tuning of a hand-written grouped-experts family under TP (`llmem.derive.tp`: mixtral's and
    qwen2_moe's TP spec is traced, `experts.TP_TRACED_MOE`): its layer backward is the traced window of TP rank 0,
    as a derived MoE's, not `moe_layer_backward_moments` (whole experts: transformers' plan splits their width,
    `packed_colwise` gate_up_proj and `rowwise` down_proj, transformers 5.23 `distributed/tensor_parallel.py:473-550`,
    so rank 0 makes a 1/tp share of the intermediate gradients and expert weight gradients)."""
    return spec.derived is not None and plan.tp > 1 and not lora.is_lora(plan)


@per_spec()
def layer_backward_peak_extra_bytes(spec: ModelSpec, plan: TrainingPlan,
                                    adapter_bytes: int | None = None) -> int:
    """Bytes beyond the layer's saved tensors (and the earlier layers' and head's gradients) at the peak of a decoder
    layer's backward. Mixture-of-experts layers: `moe_layer_backward_peak_extra_bytes`.

    Dense MLP: the layer's backward peaks in its MLP, after the last MLP Linear (down_proj): its weight gradient plus
    two intermediate-sized activation gradients (d silu(gate)*up and d up; one for the gelu MLPs,
    `Family.mlp_activation`), before the MLP's saved tensors are freed, plus the gradient of the layer output
    (tokens × h), which the residual add hands to the attention branch later."""
    if spec.is_moe and spec.family.grouped_experts and not traced_experts(spec, plan):  # LoRA: the MoE block
        from llmem.components import lora_experts as adapted  # frozen (`lora_moe`) or adapted
        if adapted.adapts_experts(spec, plan):
            return max(adapted.backward_moments(spec, plan).values())
        return (lora_moe.frozen_moe_backward_peak_extra_bytes if lora.is_lora(plan)
                else moe_layer_backward_peak_extra_bytes)(spec, plan)
    if spec.derived is not None:  # traced (`llmem.derive.Derived.backward_extra_bytes`); a gradient freed at its
        # hook lives only through the event that makes it, as one added in place (`accumulated_backward_extra_bytes`)
        if freed_at_hook(plan):
            return spec.derived.accumulated_backward_extra_bytes(spec, plan)
        return spec.derived.backward_extra_bytes(spec, plan)
    mlp = [p for p in spec.layer_params(0) if (".mlp." in p.name or ".fc" in p.name) and len(p.shape) >= 2]
    # the last MLP Linear is the one registered last (down_proj, c_proj, fc2, dense_4h_to_h); phi3's fused
    # gate_up_proj is twice its size and has no gradient yet
    weight = local_numel(mlp[-1], plan) if mlp else 0
    if freed_at_hook(plan):  # its hook copies it into its bucket (or steps and frees it) before the next node runs
        weight = 0
    tokens = plan.batch_size * plan.seq_len
    inter = spec.intermediate_size // plan.tp
    if spec.family.mlp_activation == "bloom-gelu":
        # BloomGelu's custom backward (`bloom_gelu_back`): tanh_out and four more 4h-sized products of
        # `0.5*x*((1-tanh_out*tanh_out)*(c + c3*x*x)) + 0.5*(1+tanh_out)` live with the incoming gradient, after
        # dense_4h_to_h's backward freed the gelu output it saved: 5 intermediate-sized tensors beyond it.
        inter_grads = 5
    elif spec.family.mlp_activation == "gelu":
        # x -> up -> gelu -> down: down's MmBackward0 makes one intermediate-sized gradient (of the gelu output)
        # while the up output and the gelu output are saved; when it returns the gelu output is released, and
        # gelu_backward's input gradient takes its place (measured on falcon's checkpointed layer). (OPT's relu saves
        # its output, which stays through relu's backward: two, as a gated MLP's.)
        inter_grads = 1
    else:
        inter_grads = 2
    # The gradient of the layer's output stays referenced by the residual branch through the whole layer backward.
    residual_grad = tokens * spec.hidden_size * plan.precision.param_bytes
    if lora.is_lora(plan):  # the frozen down_proj gets no weight gradient; its adapters' gradients instead
        # (`adapter_bytes` per element: 2 for the half unsharded gradients of FSDP2 mixed, `lora.half_adapters`)
        return (lora.largest_mlp_adapter_bytes(spec, plan, adapter_bytes) + lora.mlp_backward_gradient_bytes(spec, plan)
                + residual_grad)
    return (weight * plan.precision.param_bytes + inter_grads * tokens * inter * plan.precision.compute_bytes
            + residual_grad)


def layer_backward_held_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`--grad-accum`, micro-steps 2..K: how much less than micro-step 1 a layer's MLP backward moment holds beyond
    every `.grad` — the layer's weight gradients AccumulateGrad has already taken there. Grouped-experts MoE: per
    moment (`moe_held_gradient_bytes`); traced layers: their window with each weight gradient added in place. Dense
    tables: 0 (their moment counts only the last Linear's weight gradient, not yet taken)."""
    if spec.is_moe and spec.family.grouped_experts and not lora.is_lora(plan) and not traced_experts(spec, plan):
        return moe_layer_backward_peak_extra_bytes(spec, plan) - moe_layer_backward_peak_extra_bytes(spec, plan, True)
    if spec.derived is not None:  # traced: the window with each weight gradient added in place (`llmem.derive`)
        return (spec.derived.backward_extra_bytes(spec, plan)
                - spec.derived.accumulated_backward_extra_bytes(spec, plan))
    return 0


def embedding_input_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradient arriving at the embedding output (tokens × h) while the embedding's backward runs.
    LoRA: the frozen embedding runs no backward (a trainable copy of it does)."""
    if not trainable(spec, plan).embedding_backward:
        return 0
    return plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


@per_spec("layout_key")
def embedding_gradient_accumulate_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Tied embeddings: `embedding_dense_backward` returns a full V×h gradient that AccumulateGrad adds into the
    lm_head's existing `.grad` — one extra embedding-sized tensor at the end of backward."""
    return trainable(spec, plan).shared


@per_spec()  # (the chunk count reads the sequence length)
def tied_gradient_sum_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Tied embeddings outside autocast: the shared weight's AccumulateGrad receives two gradients — the lm_head's
    first, then the embedding's dense one — and the engine's InputBuffer sums them before `.grad` sees them
    (torch/csrc/autograd/input_buffer.cpp `accumulate`). The lm_head's arrives as a view (MmBackward0's gradient of
    the transposed weight, `mm(...).t()`, transposed back by TBackward0), so `can_accumulate_inplace` (sole owner of
    the storage) fails and the sum is out of place: `aten::add.Tensor` makes a third embedding-sized tensor beside
    its two addends. Under autocast the lm_head's gradient is ToCopyBackward0's fresh fp32 copy and the sum is
    `add_` in place (0 here). LoRA: the frozen embedding runs no backward. `--loss chunked-ce` with two chunks or
    more: the lm_head's gradient is the out-of-place sum of the chunks' (`chunked_ce.lm_head_backward_bytes`), a fresh
    tensor, so the embedding's is added into it in place (0; measured: no third tensor at the end of backward)."""
    if plan.precision.is_mixed or (chunked_ce.is_chunked(plan) and len(chunked_ce.chunk_tokens(plan)) > 1):
        return 0
    return trainable(spec, plan).shared


@per_spec("layout_key")
def accumulated_embedding_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Micro-steps 2..K of `--grad-accum` at the end of backward: the gradient micro-step 1 had just produced there
    (and `gradient_bytes` counted as the `.grad` it became) is now a new tensor beside the existing `.grad`, until
    AccumulateGrad adds it in place (`variable_grad += new_grad`, grad mode off) and frees it. Untied: the
    embedding's dense gradient (`embedding_dense_backward`). Tied: the lm_head's weight gradient, waiting in the
    shared weight's InputBuffer for the embedding's (which `embedding_gradient_accumulate_bytes` counts).
    LoRA: a trainable embedding copy's dense gradient (untied: tied models are refused with copies).
    `--ddp-bucket-view`: 0. Micro-step 1 held that gradient as a tensor of its own too (`backward_end_gradient_bytes`:
    the `.grad` AccumulateGrad stole is copied into its bucket view by the Reducer's hook, `mark_variable_ready_dense`,
    and then freed), and in micro-step 2 it is added into the `.grad` bucket view in place and freed: the same bytes."""
    return 0 if freed_at_hook(plan) else trainable(spec, plan).embedding


@per_spec("layout_key")
def attention_backward_layer_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Falcon (parallel attention): the weight gradients a layer has produced when its attention core runs
    backward — the MLP's (its backward ran first) and the attention output projection's (`dense`); in their buckets
    under `--ddp-bucket-view`."""
    if freed_at_hook(plan):
        return 0
    params = [p for p in spec.layer_params(0) if ".mlp." in p.name or "self_attention.dense" in p.name]
    return sum(local_numel(p, plan) for p in params) * plan.precision.param_bytes


def layer_output_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradient of a decoder layer's output (tokens × h, param dtype), alive through the layer's backward (the
    residual add hands it to the attention branch later); `layer_backward_peak_extra_bytes` counts it too."""
    return plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


from llmem.components.moe_backward import (  # noqa: E402, F401 (re-exported; they use the terms above)
    moe_held_gradient_bytes,
    moe_layer_backward_moments,
    moe_layer_backward_peak_extra_bytes,
)
