"""A checkpointed decoder layer's returned attention probabilities, kept beside the next layer's forward.

Falcon's and BLOOM's decoder layers return their eager attention probabilities with their output, and the model's
loop keeps that tuple in a local until the next layer returns (transformers 5.23 `models/falcon/modeling_falcon.py`:
`FalconDecoderLayer.forward` line 623 `return output, attn_weights`, `FalconModel.forward` lines 790-800
`outputs = block(...)`, `hidden_states = outputs[0]`; `models/bloom/modeling_bloom.py`: `BloomBlock.forward` line 402,
`BloomModel.forward` lines 531-540). `all_self_attentions` collects them only under `output_attentions`; the loop's
`outputs` holds them regardless. A layer that saves its tensors saves these probabilities anyway (the `@ value`
matmul and the softmax backward keep them); a checkpointed one saves nothing (torch 2.13
`torch/utils/checkpoint.py`, the non-reentrant `_checkpoint_hook` packs a holder, not the tensor), so layer i's
probabilities are a tensor of their own through layer i + 1's forward (`returned_bytes`). The last layer's forward
is where every checkpointed layer's input is held, so the moment is that layer's eager softmax
(`falcon_softmax_bytes`, `bloom_softmax_bytes`): its locals, the scores, their sum with the float mask and the
softmax's output, beside the previous layer's probabilities. A checkpointed forward keeps no autocast weight copy of
these families' attention (falcon's `FalconLinear` computes `input @ self.weight.T`, whose cast autocast does not
cache; BLOOM's query_key_value runs before the moment and its cast weight dies with the matmul).
Which families: `Family.returns_attention_probs`, checked against a real forward by
`tests/components/test_returned_probs.py` (a decoder layer whose output carries a batch x heads x seq x seq tensor).
A traced architecture (gptj, codegen, gpt_neo, mpt in 5.23: `outputs = block(...)`, `hidden_states = outputs[0]`)
needs no trait: the trace sees its layers return such tensors, traces the checkpointed program's first forward and
reads what of layer L - 2's return is alive at layer L - 1's start, and that layer's forward from its start
(`Derived.returned_probs_bytes`); the moment is their sum on top of the forward's end.
"""

from __future__ import annotations

from llmem.components.saved import FP32, _bytes, _sdpa
from llmem.plan import GradCkpt, TrainingPlan
from llmem.spec import ModelSpec

INT64 = 8


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Eager attention (the sdpa branches return None), every layer checkpointed (`--grad-ckpt full`, every layer)
    and at least two layers; not under `--activation-offload` (not checked)."""
    last = spec.num_layers - 1
    probs = spec.family.returns_attention_probs or spec.derived is not None  # traced: `forward_extra_bytes`
    return (probs and not _sdpa(spec, plan) and last >= 1
            and plan.grad_ckpt is GradCkpt.FULL and plan.checkpointed(last) and plan.checkpointed(last - 1)
            and not plan.activation_offload)


def _scores(spec: ModelSpec, plan: TrainingPlan) -> int:
    return plan.batch_size * (spec.num_heads // plan.tp) * plan.seq_len ** 2


def returned_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The previous layer's returned probabilities, in `Family.returned_probs_dtype`: falcon's
    `softmax(..., dtype=hidden_states.dtype)` (the layernorm output's, the residual dtype: fp32 under autocast),
    BLOOM's cast back to the query's (compute) dtype."""
    cb, rb = _bytes(plan)
    return _scores(spec, plan) * (cb if spec.family.returned_probs_dtype == "compute" else rb)


def falcon_softmax_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`FalconAttention.forward`'s eager branch (lines 311-357) when `F.softmax` allocates its output, in a
    checkpointed layer: the layernorm output(s) (residual dtype; the new architecture's two by default), `fused_qkv`
    (compute dtype, a local; q is a view of it), v (old multi-query: the `[-1]` index copy, kv heads, and its two
    int64 indices; new architecture: `flatten` of its broadcast, all heads; otherwise a view), q and k after RoPE
    (the residual dtype: cos and sin are the hidden states'), the scores (compute dtype, scaled in place), their sum
    with the float mask (its dtype, the parameters': the residual stream's) and the softmax output
    (`hidden_states.dtype`)."""
    cb, rb = _bytes(plan)
    tokens, h, hd = plan.batch_size * plan.seq_len, spec.hidden_size, spec.head_dim
    heads, kv = spec.num_heads // plan.tp, spec.num_kv_heads
    new = bool(spec.options.get("new_decoder_architecture"))
    norms = 2 if new and spec.options.get("num_ln_in_parallel_attn") != 1 else 1
    multi_query = not new and kv < spec.num_heads
    v = tokens * hd * cb + 2 * INT64 if multi_query else tokens * heads * hd * cb if new else 0
    k = tokens * (hd if multi_query else heads * hd) * rb
    locals_ = norms * tokens * h * rb + tokens * (spec.num_heads + 2 * kv) * hd * cb // plan.tp + v \
        + tokens * heads * hd * rb + k
    return locals_ + _scores(spec, plan) * (cb + 2 * rb)


def bloom_softmax_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`BloomAttention.forward` (lines 256-308) in a checkpointed layer, at its largest of three moments. Its locals
    throughout: the layernorm output (residual dtype), `fused_qkv` (compute dtype) and, from micro-batch 2 on, the
    copies `reshape` makes of its q, k, v views; the scores (`alibi.baddbmm`, compute dtype) and their sum with the
    float mask (the residual stream's dtype), both locals to the end. Then `F.softmax(attn_weights,
    dtype=torch.float32)` (its fp32 copy of a half input, its fp32 output), `.to(query dtype)` (the fp32 output and its
    half copy; in fp32 the output itself, kept as the probabilities), and the output projection to the residual
    `dropout_add` (the probabilities in the compute dtype, `_merge_heads`' copy, tokens x h, and the dense output and
    its sum with the residual; a LoRA-adapted dense instead its base output, `lora_B`'s output and its product by the
    scaling, in the adapters' dtype: peft 0.21.2 `tuners/lora/layer.py` `Linear.forward`)."""
    from llmem.components import lora

    cb, rb = _bytes(plan)
    tokens, h = plan.batch_size * plan.seq_len, spec.hidden_size
    locals_ = tokens * h * rb + 3 * tokens * h * cb + (plan.batch_size > 1) * 3 * tokens * h * cb
    at_softmax = _scores(spec, plan) * ((FP32 if rb != FP32 else 0) + FP32)
    at_cast = _scores(spec, plan) * (FP32 + (cb if cb != FP32 else 0))
    adapted = lora.is_lora(plan) and any(p.name.endswith("self_attention.dense.weight")
                                         for p in lora.layer0_targeted(spec, plan))
    dense = 2 * cb + 2 * lora.adapter_elem_bytes(spec) if adapted else 3 * cb
    at_add = _scores(spec, plan) * cb + tokens * h * dense
    return locals_ + _scores(spec, plan) * (cb + rb) + max(at_softmax, at_cast, at_add)


def forward_extra_bytes(spec: ModelSpec, plan: TrainingPlan, final_norm: int) -> int:
    """Above the forward's end (every saved tensor, the final norm's and the lm_head's, `final_norm`, included): the
    last layer's softmax in its checkpointed forward beside the previous layer's returned probabilities, less what
    the final norm and the lm_head save (not made yet). 0 where `applies` does not hold."""
    if not applies(spec, plan):
        return 0
    if spec.derived is not None and not spec.family.returns_attention_probs:  # a traced architecture (a hand-written
        # family's traced LoRA keeps its formulas): the checkpointed last layer's forward beside what the loop keeps
        kept, forward = spec.derived.at(spec.num_layers - 1).returned_probs_bytes(plan)
        return max(0, forward + kept - final_norm) if kept else 0
    # BLOOM's attention runs the residual add itself (`Family.attention_adds_residual`), a moment of its core's
    core = bloom_softmax_bytes if spec.family.attention_adds_residual else falcon_softmax_bytes
    return max(0, core(spec, plan) + returned_bytes(spec, plan) - final_norm)


def later_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Under autocast, of the half weight copies the forward's end counts: the last layer's Linears after its
    attention core, not cast yet at its softmax — on the hand-written table every Linear's cached copy but falcon's
    (`FalconLinear`'s cast of `weight.T` is not cached), `attention_core.forward_later_copy_bytes`; traced LoRA the
    adapters' (fp32 leaves, cached: `lora_activations.layer_adapter_cast_bytes`) of those Linears."""
    from llmem.components import autocast, lora
    from llmem.components.attention_core import _after_core, forward_later_copy_bytes

    if not applies(spec, plan) or not autocast.applies(plan):
        return 0
    if spec.derived is not None:
        if not lora.is_lora(plan):
            return 0
        after = [p for p in lora.layer0_targeted(spec, plan) if _after_core(p.name)]
        return sum(plan.lora_rank * sum(lora.in_out(spec, p)) for p in after) * plan.precision.compute_bytes
    return 0 if spec.family.transposed_weight_matmul else forward_later_copy_bytes(spec, plan)


def check(spec: ModelSpec, plan: TrainingPlan) -> None:
    """Where a checkpointed layer's probabilities sit beside a layer that is not checkpointed (`--ckpt-every K > 1`),
    beside a selectively checkpointed layer's forward, or under `--activation-offload`, the moment is not modelled
    (measured -13.7 % falcon and -7.7 % BLOOM at 1 x 512 with --ckpt-every 2, -13.4 % falcon selective): a gap."""
    from llmem.errors import GAP, InputError

    if not spec.family.returns_attention_probs or _sdpa(spec, plan) or spec.num_layers < 2:
        return
    partial = plan.grad_ckpt is GradCkpt.FULL and (plan.ckpt_every > 1 or plan.activation_offload)
    if partial or plan.grad_ckpt is GradCkpt.SELECTIVE:
        fix = "--grad-ckpt full --ckpt-every 1 (without --activation-offload)"
        raise InputError("grad-ckpt", f"{spec.model_type!r}'s decoder layers return their eager attention "
                         "probabilities, which the model keeps beside the next layer's forward; modelled with every "
                         f"layer checkpointed, not here (measured up to 14 % low); use {fix}, or --grad-ckpt none"
                         + (", or --attn sdpa" if spec.family.sdpa else ""), GAP)
