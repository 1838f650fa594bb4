"""The last decoder layer's forward under LoRA, inside down_proj's adapter (`--method lora`, fp32): a moment above the
end of forward when PEFT's dropout keeps its output and noise (docs/notes/2026-11-27-lora-dropout-forward.md)."""

from __future__ import annotations

from llmem.components.lora import _module, is_lora, layer0_targeted
from llmem.components.saved import FP32
from llmem.plan import GradCkpt, Method, Precision, TrainingPlan
from llmem.spec import ModelSpec


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """The one-GPU, FSDP and DeepSpeed walks' moment (`down_proj_forward_extra_bytes`): fp32, where it was measured;
    under autocast and pure half only a pipeline stage takes it (`components.pipeline.layer_forward_bytes`)."""
    return plan.precision is Precision.FP32 and inflight_applies(spec, plan)


def inflight_applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Hand-written dense LoRA families, one process per model replica (no TP), down_proj adapted, no checkpointing,
    no activation offload; adapters computing in fp32 (not FSDP2's half ones under mixed precision)."""
    if not is_lora(plan) or plan.method is not Method.LORA:
        return False
    from llmem.components.sharding import FSDP_SCHEMES

    if spec.derived is not None or spec.family.grouped_experts or spec.is_moe or plan.tp > 1:
        return False
    if plan.grad_ckpt is not GradCkpt.NONE or plan.activation_offload:
        return False
    if plan.precision is not Precision.FP32 and plan.scheme in FSDP_SCHEMES:
        return False
    if spec.family.mlp_activation != "gated":
        return False
    return any(_module(p).rsplit(".", 1)[-1] == "down_proj" for p in layer0_targeted(spec, plan))


def down_proj_inflight_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Inside a decoder layer's down_proj adapter (`inflight_applies`), beyond every tensor the layer saves, at the
    larger of two moments of `result = self.base_layer(x)`, `x = self._cast_input_dtype(x, lora_A.weight.dtype)`,
    `result + lora_B(lora_A(dropout(x))) * scaling` (PEFT 0.21.2 `tuners/lora/layer.py` Linear.forward, lines
    1088, 1099, 1102; the adapters are fp32):
      - unsaved and alive at both: the MLP's input (the post-attention norm's output, tokens x h, residual dtype, a
        local of `LlamaMLP.forward`) unless gate/up's lora_A saves it (fp32, dropout 0, gate or up adapted);
        down_proj's input (tokens x i, compute dtype) unless its lora_A saves it (fp32, dropout 0); from a half input
        PEFT's fp32 copy of it (tokens x i x 4), unless lora_A saves it (pure half, dropout 0; under autocast lora_A
        saves its own half cast); the base output `result` (tokens x h, compute dtype);
      - at lora_B's `* scaling`: lora_B's output and the product (tokens x h each, the compute dtype under autocast,
        else the adapters' fp32);
      - at lora_A under autocast with dropout > 0: the dropout's output (tokens x i x 4; its half cast is what lora_A
        saves), lora_B's half weight copy (counted with the layer's copies) not made yet;
      - with a half residual stream (pure half) the layer's input (its caller's argument) and the attention's residual
        sum (`residual`, a local of `LlamaDecoderLayer.forward`, transformers 5.23.0 `modeling_llama.py`): the RMSNorms
        save their fp32 copies of them (`hidden_states.to(torch.float32)`), not them.
    The layer's output (its residual add) is not made at either."""
    if not inflight_applies(spec, plan):
        return 0
    from llmem.components import autocast
    from llmem.components.saved import _bytes

    tokens, h, i = plan.batch_size * plan.seq_len, spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    mixed, p = autocast.applies(plan), plan.lora_dropout
    adapted = {_module(q).rsplit(".", 1)[-1] for q in layer0_targeted(spec, plan)}
    both = tokens * h * cb  # result
    if cb != FP32 or p or not adapted & {"gate_proj", "up_proj"}:
        both += tokens * h * rb
    if cb != FP32 or p:
        both += tokens * i * cb
    if cb != FP32 and (mixed or p):
        both += tokens * i * FP32
    if rb != FP32:
        both += 2 * tokens * h * rb
    at_b = both + 2 * tokens * h * (cb if mixed else FP32)
    at_a = both + tokens * i * FP32 - plan.lora_rank * h * cb if mixed and p else 0
    return max(at_a, at_b)


def down_proj_forward_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Beyond the end-of-forward activations (every layer's saved tensors and the final norm's), what is alive at
    `lora_B(lora_A(dropout(x))) * scaling` in the last layer's down_proj (PEFT 0.21.2 `tuners/lora/layer.py`
    Linear.forward, lines 1088 and 1102: `result = self.base_layer(x)`, then `result + lora_B(...) * scaling`):
      - down_proj's input `act_fn(gate_proj(x)) * up_proj(x)` (tokens x i), an argument of the call, unless lora_A
        saves it itself (dropout 0: `nn.Identity`); with dropout > 0 lora_A saves the dropout output and the
        dropout its noise (`layer_saved` counts both), the input is alive beside them;
      - the MLP's input (post_attention_layernorm output, tokens x h, a local of `LlamaMLP.forward`), unless
        gate/up's lora_A saves it (dropout 0 and gate or up adapted);
      - the base output `result`, lora_B's output and the product `* scaling` (3 x tokens x h);
      - the embedding output, held by the model's forward as `inputs_embeds` (transformers 5.23.0
        `modeling_llama.py` LlamaModel.forward) until it returns, where layer 0 does not save it (its input needs no
        gradient: `lora_activations.embeddings_require_grad`);
    less the final norm's saved tensors, not yet made."""
    if not applies(spec, plan):
        return 0
    from llmem.components.lora_activations import embeddings_require_grad, final_norm_bytes

    extra = down_proj_inflight_bytes(spec, plan)
    if not embeddings_require_grad(plan):
        extra += plan.batch_size * plan.seq_len * spec.hidden_size * FP32
    return extra - final_norm_bytes(spec, plan)


def down_proj_backward_freed_bytes(plan: TrainingPlan, saved: list) -> int:
    """Of down_proj's adapter saves (`saved`: `lora_activations._adapter_input_saved`), what is freed when the frozen
    base's input gradient joins the adapter branch's (`mlp_backward_gradient_bytes`), fp32 with dropout > 0: the
    branch (`result + lora_B(lora_A(dropout(x))) * scaling`, the later addend) runs first; lora_A's MmBackward0
    frees its saved dropout output, then the dropout's MulBackward0 (torch 2.13 `_dropout_impl`: `x * noise`) makes
    the branch's input gradient and frees the noise (CUDA: NativeDropoutBackward0 and its bool mask), both before
    the base's MmBackward0. Otherwise (dropout 0: lora_A saves x itself, still referenced) 0."""
    if not (plan.lora_dropout and plan.precision is Precision.FP32):
        return 0
    return sum(s.bytes for s in saved)


def embedding_leaf_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """LoRA under `--grad-ckpt full`: PEFT's input-require-grads hook (`lora_activations.embeddings_require_grad`)
    makes the frozen embeddings' output a leaf that requires grad (`output.requires_grad_(True)` on a tensor without
    a grad_fn), so backward's AccumulateGrad gives it a `.grad`; that node, in the graph the kept loss references,
    holds the leaf and its `.grad` (tokens x h each, the parameters' dtype) from the end of backward through the step
    and zero_grad, until the outputs are dropped (measured: DeepSpeed LoRA s16, +8,192 B entering the step in bf16,
    +16,384 B in fp32). QLoRA too, traced or hand-written (`embedding_output_requires_grad`: transformers' own
    hook; hand-written qwen3 nf4 fp32 4 x 128, h 256: the optimizer step read -32.8 % without it)."""
    if not (is_lora(plan) and embedding_output_requires_grad(plan)):
        return 0
    return 2 * plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


def embedding_output_requires_grad(plan: TrainingPlan) -> bool:
    """Whether the embeddings' output (layer 0's input) requires grad under LoRA/QLoRA with `--grad-ckpt full`.
    PEFT skips its own input-require-grads hook for a 4/8-bit base (peft 0.21.2 `PeftModel.
    _prepare_model_for_gradient_checkpointing`), but transformers 5.23 calls it itself once checkpointing is enabled on
    a model taking input_ids (modeling_utils.py:3189, `activation_checkpointing_enable`:
    `self.enable_input_require_grads()`); the measured step enables checkpointing (`runtime.session`)."""
    from llmem.components.lora_activations import embeddings_require_grad

    return embeddings_require_grad(plan) or (plan.method is Method.QLORA and plan.grad_ckpt is GradCkpt.FULL)
