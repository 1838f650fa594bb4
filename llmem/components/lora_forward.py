"""The last decoder layer's forward under LoRA, inside down_proj's adapter (`--method lora`, fp32): a moment above the
end of forward when PEFT's dropout keeps its output and noise (docs/notes/2026-11-27-lora-dropout-forward.md)."""

from __future__ import annotations

from llmem.components.lora import _module, is_lora, layer0_targeted
from llmem.components.saved import FP32
from llmem.plan import GradCkpt, Method, Precision, TrainingPlan
from llmem.spec import ModelSpec


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Hand-written dense LoRA families, fp32, one process per model replica (no TP), down_proj adapted, no
    checkpointing, no activation offload (other plans keep the end-of-forward moment alone)."""
    if not is_lora(plan) or plan.method is not Method.LORA or plan.precision is not Precision.FP32:
        return False
    if spec.derived is not None or spec.family.grouped_experts or spec.is_moe or plan.tp > 1:
        return False
    if plan.grad_ckpt is not GradCkpt.NONE or plan.activation_offload:
        return False
    if spec.family.mlp_activation != "gated":
        return False
    return any(_module(p).rsplit(".", 1)[-1] == "down_proj" for p in layer0_targeted(spec, plan))


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

    tokens, h, i = plan.batch_size * plan.seq_len, spec.hidden_size, spec.intermediate_size
    adapted = {_module(p).rsplit(".", 1)[-1] for p in layer0_targeted(spec, plan)}
    extra = 3 * tokens * h * FP32
    if plan.lora_dropout:
        extra += tokens * i * FP32
    if plan.lora_dropout or not adapted & {"gate_proj", "up_proj"}:
        extra += tokens * h * FP32
    if not embeddings_require_grad(plan):
        extra += tokens * h * FP32
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
