"""The last decoder layer's forward at its largest inside a grouped-experts MoE block (transformers 5.23
`integrations/moe.py: grouped_mm_experts_forward`, `models/qwen2_moe/modeling_qwen2_moe.py`,
`models/mixtral/modeling_mixtral.py`): the routed output's restore-order gather, beside every earlier layer's
saved tensors, the block's locals and the model forward's attention masks. The forward-end moment counts none of
these (they die before the forward returns) and counts what is not made yet (the final norm's saves, the shared
expert's gate)."""

from __future__ import annotations

from llmem.components.activations import final_norm_bytes, moe_routing_weight_bytes
from llmem.components.saved import _bytes, _sdpa
from llmem.plan import GradCkpt, Method, TrainingPlan
from llmem.spec import ModelSpec

FP32 = 4


def applies(spec: ModelSpec, plan: TrainingPlan, lora: bool = False) -> bool:
    """A hand-modelled grouped-experts family, full fine-tuning (`lora`: or LoRA, `lora_unsaved_bytes`), its last
    layer's forward keeping its saves (no checkpointing, no activation offload: those forwards hold the layer input
    alone), the last layer sparse (qwen2_moe's `mlp_only_layers`, `decoder_sparse_step`)."""
    from llmem.components import act_offload

    methods = (Method.FULL, Method.LORA) if lora else (Method.FULL,)
    return (spec.family.grouped_experts and spec.derived is None and plan.method in methods
            and plan.grad_ckpt is GradCkpt.NONE and not act_offload.applies(plan) and bool(spec.num_experts)
            and any(".experts." in p.name for p in spec.layer_params(spec.num_layers - 1)))


def model_mask_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The model forward's attention masks, its locals until it returns. Eager: `masking_utils.eager_mask`'s
    `torch.where(mask, 0, finfo(dtype).min)` (micro-batch × 1 × seq × seq, the embeddings' dtype rb); mixtral
    builds one (`MixtralModel.forward`: `create_causal_mask` or the sliding-window one), qwen2_moe both
    (`Qwen2MoeModel.forward`'s `causal_mask_mapping`, `Family.both_masks`). sdpa, without padding: the causal
    mask takes `sdpa_mask`'s is_causal skip (None); qwen2_moe's sliding-window one does not (its window is the
    config's 0 without `use_sliding_window`: `_ignore_causal_mask_sdpa` declines), a boolean seq × seq
    (`mask_function` over broadcast aranges, then `expand` over the batch: no copy)."""
    if _sdpa(spec, plan):
        return plan.seq_len * plan.seq_len if spec.family.both_masks else 0
    _, rb = _bytes(plan)
    masks = 2 if spec.family.both_masks or spec.family.sliding_window_layers else 1
    return masks * plan.batch_size * plan.seq_len * plan.seq_len * rb


def routed_inflight_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At `weighted_out = weighted_out[inv_perm]` (`grouped_mm_experts_forward`), beyond the block's saved tensors
    (`layer_tables.moe_saved`): `proj_out * sample_weights_g` (r × h, the promoted dtype of the experts' eb and the
    routing weights' wb; IndexBackward0 saves only the index) and its gather in restored order (r × h), both alive;
    the function's locals `histc_input` (r × fp32 on CPU; `expert_ids_g.int()` on CUDA, also 4 bytes),
    `tokens_per_expert` (E × fp32) and `expert_ids_g` (r × int64: the table's "sorted expert ids" stands for the
    `perm // num_top_k` that the tokens' gather saves, of its size, once the function has returned); the sparse
    block's `_` router logits (T × E, the compute dtype cb) and top-k routing weights (r × wb, saved by no op: the
    gathers save their indices; `Qwen2MoeSparseMoeBlock.forward` / `MixtralSparseMoeBlock.forward`); under
    autocast the post-attention norm's output, the block's input (T × h × rb): no op saves it (the Linears save
    their half casts), it is the decoder layer's `hidden_states` until the block returns (in fp32/bf16 the
    router's linear saves it: counted). In pure half precision (FSDP2's compute too) the residual stream's tensors
    no op saves (the norms save their fp32 copies): the embeddings' output (`inputs_embeds`, the model forward's
    local), the last layer's input (its `residual`) and the attention's residual sum (the MLP's `residual`),
    T × h × rb each (one fewer with one layer: its input is the embeddings' output)."""
    T = plan.batch_size * plan.seq_len
    h, e, k = spec.hidden_size, spec.num_experts, spec.experts_per_token
    r = T * k
    cb, rb = _bytes(plan)
    wb = moe_routing_weight_bytes(spec, plan)
    ob = max(plan.precision.param_bytes, wb)
    block_input = T * h * rb if plan.precision.is_mixed else 0
    residuals = (2 + (spec.num_layers > 1)) * T * h * rb if rb == 2 and not plan.precision.is_mixed else 0
    return 2 * r * h * ob + r * FP32 + e * FP32 + r * 8 + T * e * cb + r * wb + block_input + residuals


def not_yet_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """What the forward-end moment counts that does not exist yet: the final norm's saved tensors and, in
    qwen2_moe, what runs after the routed experts (`shared_expert_gate`'s autocast input cast T × h × 2 and its
    sigmoid T × cb, `Qwen2MoeSparseMoeBlock.forward`)."""
    T = plan.batch_size * plan.seq_len
    cb, _ = _bytes(plan)
    later = 0
    if spec.family.shared_expert and spec.shared_expert_intermediate_size:
        later = T * cb + (T * spec.hidden_size * 2 if plan.precision.is_mixed else 0)
    return final_norm_bytes(spec, plan) + later


def forward_extra_bytes(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> int:
    """The moment's activations beyond the forward end's (0 where it does not apply): the masks + the routed
    experts' transients − what is not made yet; LoRA (`half`: FSDP2's half adapters, `plan` the compute plan) also
    the block's tensors its table does not save (`lora_unsaved_bytes`), less its own not-yet-made saves."""
    if not applies(spec, plan, lora=True):
        return 0
    if plan.method is Method.LORA:
        return model_mask_bytes(spec, plan) + routed_inflight_bytes(spec, plan) \
            + lora_unsaved_bytes(spec, plan, half) - lora_not_yet_bytes(spec, plan, half)
    return model_mask_bytes(spec, plan) + routed_inflight_bytes(spec, plan) - not_yet_bytes(spec, plan)


# full fine-tuning's saved tensors that are also live locals at `weighted_out[inv_perm]`: `selected_hidden_states_g`
# (`grouped_mm_experts_forward`) and the block input (the decoder layer's `hidden_states`)
_LIVE_LOCALS = ("gathered tokens (tokens × top_k)", "post_attention_layernorm.output")


def lora_unsaved_bytes(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> int:
    """LoRA, at `weighted_out[inv_perm]`: the tensors alive there that full fine-tuning's table saves (so its moment
    counts them) and LoRA's (`lora_activations.layer_saved`) does not. `selected_hidden_states_g` (r × h): a local
    of `grouped_mm_experts_forward` until it returns, saved only for the experts' weight gradient (a frozen
    `grouped_mm` saves its weight alone); the block input (T × h × rb, the post-attention norm's output: the
    decoder layer's `hidden_states` until the block returns; the frozen router's linear saves only its weight;
    under autocast `routed_inflight_bytes` has it); unless an adapter keeps it (mixtral's adapted stacks and router,
    `lora_experts.KEPT`; qwen2_moe's shared-expert lora_A at dropout 0). And the embeddings' output (T × h × rb):
    the model forward's `inputs_embeds` until it returns; layer 0's input needs no gradient under LoRA
    (`lora_activations.embeddings_require_grad`), so no op saves it (in pure half `routed_inflight_bytes` has it).
    Sources: transformers 5.23 `integrations/moe.py: grouped_mm_experts_forward`,
    `models/mixtral/modeling_mixtral.py` (`MixtralDecoderLayer.forward`, `MixtralModel.forward`),
    `models/qwen2_moe/modeling_qwen2_moe.py`."""
    from llmem.components import activations as act
    from llmem.components import lora_activations as lora

    full = {s.name: s.bytes for s in act.layer_saved(spec, plan)}
    kept = lora.layer_saved(spec, plan, half=half)
    names = {s.name for s in kept}
    out = sum(full.get(n, 0) for n in _LIVE_LOCALS if n not in names)
    if "post_attention_layernorm.output" not in names and any(
            "gate_proj" in s.name and s.name.endswith("input kept by lora_A") for s in kept):
        out -= full.get("post_attention_layernorm.output", 0)  # the shared expert's lora_A keeps the block input
    _, rb = _bytes(plan)
    if not lora.layer0_input_requires_grad(spec, plan) and not (rb == 2 and not plan.precision.is_mixed):
        out += plan.batch_size * plan.seq_len * spec.hidden_size * rb
    return out


def lora_not_yet_bytes(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> int:
    """`not_yet_bytes` on LoRA's tables: the final norm's LoRA saves (`lora_activations.final_norm_bytes`) and what
    qwen2_moe's `shared_expert_gate` (run after the routed experts) saves: its sigmoid where the table has it
    (T × cb) and an adapted gate's own adapter saves (`lora_moe._shared_gate_adapter_bytes`); the frozen gate's
    input cast is not saved."""
    from llmem.components import lora_activations as lora
    from llmem.components.lora_moe import _shared_gate_adapter_bytes

    sigmoid = sum(s.bytes for s in lora.layer_saved(spec, plan, half=half) if s.name == "shared_expert_gate sigmoid")
    gate = _shared_gate_adapter_bytes(spec, plan)[1] if spec.family.shared_expert else 0
    return lora.final_norm_bytes(spec, plan) + sigmoid + gate


def final_norm_forward_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Inside the final RMSNorm's forward, at `self.weight * hidden_states.to(input_dtype)` (`Qwen2MoeRMSNorm`,
    `MixtralRMSNorm`), beyond the forward end's saves: the model forward's masks (`model_mask_bytes`) and, in pure
    half precision (no autocast: FSDP2's bf16 parameters too), `hidden_states * rsqrt(...)` (T × h × fp32, no op
    saves it: `.to` saves nothing), the last layer's output and the embeddings' output (T × h × rb each: the model
    forward's locals, which the norms' fp32 copies stand for in autograd). In fp32 or under autocast (an fp32
    residual stream) the same tensors are the ones saved. Measured on the grouped-experts families only (0
    elsewhere)."""
    if not applies(spec, plan):
        return 0
    T = plan.batch_size * plan.seq_len
    _, rb = _bytes(plan)
    half = rb == 2 and not plan.precision.is_mixed
    return model_mask_bytes(spec, plan) + (T * spec.hidden_size * (FP32 + 2 * rb) if half else 0)
