"""A hand-written family's buffers: the tensors its modules register beside their parameters (`nn.Buffer`, all
non-persistent), made when the model is built and alive through the whole step, on every rank whole (no scheme
shards a buffer: FSDP2's `fully_shard` and DTensor's `parallelize_module` leave them plain tensors; DDP broadcasts
them in place), neither trainable nor in the optimizer. A traced architecture's are `llmem.derive.buffers`.

transformers 5.23.0 (`models/<type>/modeling_<type>.py`):
- RoPE (`Family.rope`): `<Type>RotaryEmbedding.__init__` registers `inv_freq` and `original_inv_freq =
  inv_freq.clone()` (llama :86-87), `inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))`
  (:105): ceil(dim / 2) fp32 elements each, fp32 whatever the model's dtype (the model is built in its dtype by
  `from_config(dtype=...)`, which leaves an explicit `dtype=torch.float` alone). dim = head_dim (llama :101, falcon
  :131), times partial_rotary_factor where the default RoPE reads it (phi3 :95-97, gpt_neox :80-82).
- Gemma's scaled embedding (`Family.scaled_embeddings`): `embed_scale = nn.Buffer(torch.tensor(embed_scale))`
  (gemma :57, gemma2 :338), a scalar in the default dtype, i.e. the model's (4 B fp32 and mixed, 2 B bf16/fp16).
  `forward` multiplies by `embed_scale.to(self.weight.dtype)`, the buffer itself (same dtype): the product saves it,
  no copy.
- FSDP1 with mixed precision casts them to the half dtype at its lazy init, in place (`buffer.data =
  buffer.to(device=device, dtype=buffer_dtype)`, torch 2.13 `fsdp/_runtime_utils.py:1650-1654`, from :140).
- GPT-2, OPT, BLOOM: none (GPT-2's causal `bias` mask is gone in 5.x; BLOOM's ALiBi is made in the forward).
"""

from __future__ import annotations

from llmem.components.saved import _p
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

FP32 = 4


def rotary_dim(spec: ModelSpec) -> int:
    """The dims RoPE rotates: head_dim, times `rotary_pct` (partial_rotary_factor) where the family reads it."""
    return spec.head_dim if spec.options.get("rotary_pct") is None else int(spec.head_dim * _p(spec, "rotary_pct"))


def buffer_bytes(spec: ModelSpec, plan: TrainingPlan, cast_bytes: int | None = None) -> int:
    """inv_freq and original_inv_freq (ceil(rotary_dim / 2) fp32 each) under RoPE; Gemma's embed_scale scalar in
    the model's dtype. `cast_bytes`: every buffer's element size after a cast of the module's floating buffers
    (FSDP1's `MixedPrecision(buffer_dtype=<half>)`)."""
    family = spec.family
    rope = 2 * ((rotary_dim(spec) + 1) // 2) if family.rope else 0
    scale = 1 if family.scaled_embeddings else 0
    if cast_bytes is not None:
        return (rope + scale) * cast_bytes
    return rope * FP32 + scale * plan.precision.param_bytes
