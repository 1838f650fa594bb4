"""Gradients held on one rank once backward has produced them.

bytes = local_params * param_bytes: `.grad` has the parameter's dtype (fp32 under mixed precision: autocast's cast
backward returns fp32). FSDP2 keeps only the reduce-scattered shard; DDP and ZeRO-1 keep full gradients.
Gradients of decoder layer l exist from the backward of layer l on (`zero_grad(set_to_none=True)` frees them).
LoRA: only the fp32 adapters get gradients (`llmem.components.lora`); the frozen embeddings run no backward.
"""

from llmem.components import lora
from llmem.components.sharding import local_numel, shard_summary
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if lora.is_lora(plan):
        return lora.adapter_bytes(spec, plan)
    return shard_summary(spec, plan).total * plan.precision.param_bytes


def layer_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    if lora.is_lora(plan):
        return lora.layer_adapter_bytes(spec, plan, layer)
    return shard_summary(spec, plan).per_layer[layer] * plan.precision.param_bytes


def later_layers_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Gradients of the layers after `layer`, which backward has already produced."""
    if lora.is_lora(plan):
        return sum(lora.layer_adapter_bytes(spec, plan, k) for k in range(layer + 1, spec.num_layers))
    return sum(shard_summary(spec, plan).per_layer[layer + 1:]) * plan.precision.param_bytes


def head_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Gradients that exist once the lm_head and final norm have run backward: every tensor outside the decoder
    layers except the input embeddings (whose gradient comes last) — unless tied, then the shared weight's.
    LoRA: the adapters outside the decoder layers (none with all-linear on llama-like models)."""
    if lora.is_lora(plan):
        return lora.outer_adapter_bytes(spec, plan)
    outer = spec.outer_params
    skip = () if spec.tie_word_embeddings else (outer[0],)
    positional = tuple(p for p in outer if "wpe" in p.name or "embed_positions" in p.name)
    return sum(local_numel(p, plan) for p in outer if p not in skip + positional) * plan.precision.param_bytes


def layer_backward_peak_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """A layer's backward peaks in its MLP, after the last MLP Linear (down_proj): its weight gradient plus two
    intermediate-sized activation gradients (d silu(gate)*up and d up), before the MLP's saved tensors are freed,
    plus the gradient of the layer output (tokens × h), which the residual add hands to the attention branch later."""
    mlp = [p for p in spec.layer_params(0) if (".mlp." in p.name or ".fc" in p.name) and len(p.shape) >= 2]
    weight = max((local_numel(p, plan) for p in mlp), default=0)
    tokens = plan.batch_size * plan.seq_len
    inter = spec.intermediate_size // plan.tp
    if spec.model_type == "bloom":
        # BloomGelu's custom backward (`bloom_gelu_back`): tanh_out and four more 4h-sized products of
        # `0.5*x*((1-tanh_out*tanh_out)*(c + c3*x*x)) + 0.5*(1+tanh_out)` live with the incoming gradient, after
        # dense_4h_to_h's backward freed the gelu output it saved: 5 intermediate-sized tensors beyond it.
        inter_grads = 5
    else:
        inter_grads = 2
    # The gradient of the layer's output stays referenced by the residual branch through the whole layer backward.
    residual_grad = tokens * spec.hidden_size * plan.precision.param_bytes
    if lora.is_lora(plan):  # the frozen down_proj gets no weight gradient; its adapters' gradients instead
        return (lora.largest_mlp_adapter_bytes(spec, plan) + inter_grads * tokens * inter * plan.precision.compute_bytes
                + residual_grad)
    return (weight * plan.precision.param_bytes + inter_grads * tokens * inter * plan.precision.compute_bytes
            + residual_grad)


def embedding_input_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradient arriving at the embedding output (tokens × h) while the embedding's backward runs.
    LoRA: the frozen embedding runs no backward."""
    if lora.is_lora(plan):
        return 0
    return plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


def embedding_gradient_accumulate_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Tied embeddings: `embedding_dense_backward` returns a full V×h gradient that AccumulateGrad adds into the
    lm_head's existing `.grad` — one extra embedding-sized tensor at the end of backward."""
    if not spec.tie_word_embeddings or lora.is_lora(plan):
        return 0
    emb = spec.outer_params[0]
    return local_numel(emb, plan) * plan.precision.param_bytes


def attention_backward_layer_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Falcon (parallel attention): the weight gradients a layer has produced when its attention core runs
    backward — the MLP's (its backward ran first) and the attention output projection's (`dense`)."""
    params = [p for p in spec.layer_params(0) if ".mlp." in p.name or "self_attention.dense" in p.name]
    return sum(local_numel(p, plan) for p in params) * plan.precision.param_bytes
