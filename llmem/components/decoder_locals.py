"""The forward's last moments inside the decoder's own forward, before it returns: its locals, and GPT-NeoX's parallel
residual add. Which family keeps which is read from its traits (`Family.forward_locals`, `attention_adds_residual`,
`parallel_residual_sum`, `last_block_moments`), not its model_type.

The decoder's forward (`GPT2Model`, `OPTDecoder`, `GPTNeoXModel`) keeps tensors in Python locals that no autograd
node saves until it returns, right after the final norm: they sit beside every saved activation and the final
norm's output, then go before the lm_head runs (`decoder_locals_bytes`, transformers 5.23):
- GPT-2 (`models/gpt2/modeling_gpt2.py` lines 84-92 of `GPT2Model.forward`'s body: `inputs_embeds = self.wte(...)`,
  `position_embeds = self.wpe(position_ids)` with position ids of one row, `hidden_states = inputs_embeds +
  position_embeds`, then `self.drop(hidden_states)` rebinds the sum): the word embeddings (tokens × h) and the
  position embeddings (seq × h), in the parameters' dtype (an embedding is not autocast).
- OPT (`models/opt/modeling_opt.py`, `OPTDecoder.forward`: `inputs_embeds` (project_in's output when
  word_embed_proj_dim differs: autocast's half), `position_attention_mask = torch.ones(batch, seq)` (fp32),
  `position_ids = (cumsum(mask) * mask - 1).long()` (`OPTLearnedPositionalEmbedding` embeds `position_ids + 2`, a
  new tensor, counted in `activations.outer_saved`), `pos_embeds` (tokens × h)).
- GPT-NeoX (`models/gpt_neox/modeling_gpt_neox.py` lines 333-334 and 344: `position_ids = arange(seq).unsqueeze(0)`
  (int64), `hidden_states = self.emb_dropout(inputs_embeds)`: with hidden_dropout > 0 the embeddings stay a local
  beside their dropped copy, layer 0's input).
- BLOOM (`models/bloom/modeling_bloom.py`, `BloomModel.forward`): `alibi` (batch·heads × 1 × seq, the hidden
  states' dtype: the parameters').
- Eager attention (each of them): the float causal mask (`activations.eager_mask_held_saved`'s, micro-batch × 1 ×
  seq², the embeddings' dtype), which a checkpointed layer holds longer.
BLOOM's attention (`BloomAttention.forward`, lines 259-308) runs its residual `dropout_add` itself, so when that add
allocates the layer's residual its locals are alive beside every tensor saved so far: `alibi.baddbmm`'s scores
(compute dtype) and their sum with the mask (`attention_core.recompute_locals_bytes`, which counts the same locals in
a checkpointed layer's recompute), the dense output, `fused_qkv` from micro-batch 2 on (at 1, q, k and v are views of
it and it is saved), and under autocast the fp32 layernorm output (its half cast is what query_key_value saves).
GPT-NeoX with `use_parallel_residual` (its default; lines 258-263): `attn_output = post_attention_dropout(...)`,
`mlp_output = post_mlp_dropout(mlp(...))`, then `hidden_states = mlp_output + attn_output + hidden_states` — two
out-of-place adds (left to right), so when the second allocates the layer output the attention output, the MLP
output and their sum are alive beside it: three tokens × h tensors in the compute dtype nothing saves (a dropout's
`mul` keeps its noise). They go when the add returns; the final norm's saved tensors are not made yet.
With a tiny vocabulary (small logits) these moments can be the iteration's peak.
"""

from __future__ import annotations

from llmem.components import autocast
from llmem.components.saved import FP32, _bytes, _proj_dim, _sdpa
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec

INT64 = 8


def _hand_full(spec: ModelSpec, plan: TrainingPlan) -> bool:
    return spec.derived is None and plan.method is Method.FULL


def _embeds(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The word embeddings (tokens × h): the parameters' dtype (an embedding is not autocast), or autocast's half
    where OPT's project_in makes them (word_embed_proj_dim differs from hidden)."""
    cb, _ = _bytes(plan)
    return plan.batch_size * plan.seq_len * spec.hidden_size * (
        cb if _proj_dim(spec) != spec.hidden_size else plan.precision.param_bytes)


def _rows(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Position ids per sequence (OPT's, from the mask's cumsum) or one row for the batch."""
    return plan.batch_size if spec.family.batched_position_ids else 1


def _position_embeds(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The learned position embeddings (rows × seq × h), the parameters' dtype."""
    return _rows(spec, plan) * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


def _position_ids(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The position ids (rows × seq), int64."""
    return _rows(spec, plan) * plan.seq_len * INT64


def _position_mask(spec: ModelSpec, plan: TrainingPlan) -> int:
    """OPT's `torch.ones(batch, seq)` position mask, fp32."""
    return plan.batch_size * plan.seq_len * FP32


def _undropped(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The embeddings kept beside their dropped copy, when the embedding dropout makes one (p > 0)."""
    dropout = (spec.options.get(spec.family.embedding_dropout[1]) or 0) > 0
    return dropout * plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


def _alibi(spec: ModelSpec, plan: TrainingPlan) -> int:
    """BLOOM's ALiBi biases (batch·heads × 1 × seq), the hidden states' dtype: the parameters'."""
    return plan.batch_size * spec.num_heads * plan.seq_len * plan.precision.param_bytes


def _eager_mask(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Eager attention's float causal mask (micro-batch × 1 × seq², the embeddings' dtype); none under sdpa."""
    return 0 if _sdpa(spec, plan) else plan.batch_size * plan.seq_len ** 2 * _bytes(plan)[1]


LOCALS = {  # `Family.forward_locals`: each local's bytes (this rank's tokens)
    "inputs_embeds": _embeds, "position_embeds": _position_embeds, "position_ids": _position_ids,
    "position_attention_mask": _position_mask, "undropped_embeds": _undropped, "alibi": _alibi,
    "eager_mask": _eager_mask,
}


def decoder_locals_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The decoder forward's unsaved locals alive from its start to its return (this rank's tokens):
    `Family.forward_locals`, each sized by `LOCALS`."""
    if not _hand_full(spec, plan):
        return 0
    return sum(LOCALS[name](spec, plan) for name in spec.family.forward_locals)


def bloom_attention_add_bytes(spec: ModelSpec, plan: TrainingPlan, final_norm: int) -> int:
    """Above the forward's end: BLOOM's last attention at its residual add — its locals (module docstring) beside the
    decoder's, less what the layer saves after that add (the post-attention norm's, the MLP's), what the final norm
    and the lm_head save (`final_norm`) and, under autocast, the last MLP's half weight copies; 0 for the other
    families."""
    if not (_hand_full(spec, plan) and spec.family.attention_adds_residual):
        return 0
    from llmem.components import activations as act
    from llmem.components.attention_core import recompute_mlp_saved_bytes

    lp = act.layer_plan(plan, spec.num_layers - 1)
    later = recompute_mlp_saved_bytes(spec, lp, tuple(act.layer_saved(spec, lp)))
    b, s, h = plan.batch_size, plan.seq_len, spec.hidden_size
    cb, rb = _bytes(plan)
    scores = b * spec.num_heads * s * s
    local = scores * (cb + max(cb, plan.precision.param_bytes)) + b * s * h * cb
    local += (b > 1) * 3 * b * s * h * cb + autocast.applies(plan) * b * s * h * rb
    mlp_copies = autocast.weight_copy_bytes(spec, plan, lambda name: ".mlp." in name)  # (the walk's forward counts
    # every layer's autocast weight copies; the last MLP's are not made yet)
    return local + decoder_locals_bytes(spec, plan) - later - final_norm - mlp_copies


def parallel_add_applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """GPT-NeoX's parallel residual (`Family.parallel_residual_sum`, unless the config turns it off), full
    fine-tuning on the hand-written table."""
    return (_hand_full(spec, plan) and spec.family.parallel_residual_sum
            and spec.options.get("use_parallel_residual") is not False)


def inflight_bytes(spec: ModelSpec, plan: TrainingPlan, final_norm: int) -> int:
    """Above the forward's end (every saved tensor, the final norm's and the lm_head's included): the larger of
    - the final norm's forward, the decoder's locals alive (`decoder_locals_bytes`); under autocast the norm's output
      is fp32 (LayerNorm runs in fp32) and the lm_head's half cast of it (which the end counts) not made yet — OPT's
      project_out, where it exists, makes its own output beside both;
    - GPT-NeoX's last parallel residual add: the three unsaved tokens × h tensors (compute dtype) and the locals, less
      what the final norm and the lm_head save (`final_norm`, `activations.final_norm_saved`) but the norm's input,
      the layer output this add makes (the residual stream's dtype);
    - BLOOM's last attention's residual add (`bloom_attention_add_bytes`);
    - GPT-2's last attention inside sdpa's CPU math path (`gpt2_math_sdpa_bytes`) and its last block's MLP output
      dropout (`gpt2_block_end_bytes`).
    0 where none applies."""
    local = decoder_locals_bytes(spec, plan)
    if not local:
        return 0
    tokens_h = plan.batch_size * plan.seq_len * spec.hidden_size
    cb, rb = _bytes(plan)
    at_norm = local
    if autocast.applies(plan):
        at_norm += tokens_h * rb - (tokens_h * cb if _proj_dim(spec) == spec.hidden_size else 0)
    at_add = 0
    if parallel_add_applies(spec, plan):
        at_add = 3 * tokens_h * cb + local - (final_norm - tokens_h * rb)
    return max(0, at_norm, at_add, bloom_attention_add_bytes(spec, plan, final_norm),
               gpt2_math_sdpa_bytes(spec, plan, final_norm), gpt2_block_end_bytes(spec, plan, final_norm))


def gpt2_block_end_bytes(spec: ModelSpec, plan: TrainingPlan, final_norm: int) -> int:
    """Above the forward's end: GPT-2's last block at its MLP's output dropout (`GPT2Block.forward`: `attn_output`
    stays a local until the block returns; `GPT2MLP.forward`: `c_proj`'s output, then `self.dropout` makes the dropped
    copy beside it and its noise, which is saved), so three tokens × h tensors in the compute dtype (two without
    resid_pdrop) beside every saved tensor but the final norm's and lm_head's (`final_norm`), and the decoder's
    locals."""
    if not (_hand_full(spec, plan) and spec.family.last_block_moments):
        return 0
    from llmem.components.saved import _p

    tokens_h = plan.batch_size * plan.seq_len * spec.hidden_size
    unsaved = 2 + (_p(spec, "resid_pdrop") > 0)
    return unsaved * tokens_h * _bytes(plan)[0] + decoder_locals_bytes(spec, plan) - final_norm


def gpt2_math_sdpa_bytes(spec: ModelSpec, plan: TrainingPlan, final_norm: int) -> int:
    """Above the forward's end: GPT-2's last attention inside sdpa's CPU math path (attention dropout > 0 on CPU,
    `saved.attention_saved`), when it casts its output back (torch 2.13 `_scaled_dot_product_attention_math`, its
    ops as dispatched: q, k, v `to(float32)`, the causal mask `ones(s, s).tril()` turned into an fp32 `where`, the
    scores, `_safe_softmax`, dropout, the probabilities `to(origin dtype)` (returned, discarded by the caller), the
    bmm by v, its output `to(origin dtype)`). Alive then beside every tensor saved so far: the fp32 mask (seq²);
    from a half input the upcast q and k, the probabilities' half copy, the fp32 bmm output and the half output
    (in fp32 the casts are the tensors themselves: the bmm output only); from micro-batch 2 on, where the bmm
    operands are copies, `q * scale` and the upcast v too; the block's locals — c_attn's output,
    whose q/k/v views the attention holds (unless the table counts it as v's saved view), and under autocast ln_1's
    fp32 output (c_attn saves its half cast) — and the decoder's. Less what the layer saves after the bmm, the final
    norm's and lm_head's saves (`final_norm`) and under autocast the later Linears' half weight copies."""
    from llmem.components import activations as act
    from llmem.components.attention_backward import _DROPPED
    from llmem.components.attention_core import forward_later_copy_bytes

    if not (_hand_full(spec, plan) and spec.family.last_block_moments):
        return 0
    lp = act.layer_plan(plan, spec.num_layers - 1)
    items = tuple(act.layer_saved(spec, lp))
    k = next((i for i, it in enumerate(items) if it.name.startswith(_DROPPED[1])), None)
    if k is None:  # not the math path
        return 0
    b, s, h = plan.batch_size, plan.seq_len, spec.hidden_size
    cb, rb = _bytes(plan)
    tq = b * s * spec.num_heads * spec.head_dim
    probs = items[k].bytes // FP32 * cb
    local = s * s * FP32 + tq * FP32 + (2 * tq * FP32 + probs + tq * cb if cb != FP32 else 0)
    if b > 1:  # the bmm operands are copies (`at::matmul`'s expand + reshape), which the table counts: q * scale
        local += tq * FP32 * (1 + (cb != FP32))  # stays a local, and so does the upcast v
    if not any("view of the fused" in it.name for it in items):
        local += 3 * tq * cb  # c_attn's output
    local += autocast.applies(plan) * b * s * h * rb
    later = sum(it.bytes for it in items[k + 1:])
    return local + decoder_locals_bytes(spec, plan) - later - final_norm - forward_later_copy_bytes(spec, plan)
