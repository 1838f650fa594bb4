"""A checkpointed decoder layer's first forward, inside its gated MLP (`--grad-ckpt full`, full fine-tuning, the
hand-written llama-like tables): what is alive beyond what the checkpoint keeps (its inputs) when nothing is saved.

torch 2.13.0's non-reentrant checkpoint (torch/utils/checkpoint.py, `_checkpoint_hook`) packs every saved tensor into
a holder that keeps no data in the first forward, so each intermediate of the layer lives only as long as Python
references it. transformers 5.23.0 `models/llama/modeling_llama.py`: `LlamaDecoderLayer.forward` keeps `residual`
(the attention's residual sum) and `hidden_states` (the post-attention norm's output, `LlamaMLP.forward`'s `x`)
through the MLP; `LlamaMLP.forward` computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`.
"""

from __future__ import annotations

from llmem.components import autocast
from llmem.components.saved import _bytes
from llmem.plan import GradCkpt, Method, TrainingPlan
from llmem.spec import ModelSpec


def applies(spec: ModelSpec, plan: TrainingPlan, layer: int) -> bool:
    """Full fine-tuning on the hand-written dense tables, gated MLP, decoder layer `layer` checkpointed in full."""
    return (plan.method is Method.FULL and spec.derived is None and not spec.is_moe and plan.tp == 1
            and spec.family.mlp_activation == "gated" and plan.grad_ckpt is GradCkpt.FULL
            and plan.checkpointed(layer) and not plan.activation_offload)


def mlp_forward_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Beyond the layer's checkpointed inputs, at the larger of two moments of its MLP (the layer's output not made):
      - at `act_fn(gate) * up`: `residual` and `x` (tokens x h each, the residual stream's dtype), the activation's
        output, up_proj's output and their product (tokens x i each, the compute dtype; gate_proj's output went
        when the activation returned); under autocast down_proj's half weight copy is not made yet (the forward's
        autocast cache counts every checkpointed layer's copies);
      - at down_proj: `residual`, `x`, its input (the product) and its output (tokens x h, compute dtype).
    0 where `applies` does not hold."""
    if not applies(spec, plan, layer):
        return 0
    tokens, h, i = plan.batch_size * plan.seq_len, spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    locals_ = 2 * tokens * h * rb
    down_copy = autocast.weight_copy_bytes(spec, plan, lambda name: name.endswith("mlp.down_proj.weight"))
    at_mul = locals_ + 3 * tokens * i * cb - down_copy
    at_down = locals_ + tokens * i * cb + tokens * h * cb
    return max(at_mul, at_down)
