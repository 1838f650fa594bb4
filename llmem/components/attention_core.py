"""The backward of an eager attention core: the moment `_softmax_backward_data` allocates its output.

Eager attention (transformers 5.23 `eager_attention_forward` and the families' own eager branches) saves s-sized
tensors (the softmax output, the probabilities cast back to half) that sdpa does not. Its backward runs after the
layer's MLP and output projection have run backward (autograd's ready queue runs the node of the highest sequence
number first: the ops made last in forward), so at `SoftmaxBackward0` the layer holds:
- of its saved tensors, those of the ops before the softmax (the norm, the q/k/v inputs and operands, the softmax
  output itself); the later ones (probabilities cast and dropout, v, attention output, MLP) were released with
  their nodes (`eager_core_released`);
- the weight gradients of the Linears after the attention core (MLP, o_proj), `eager_core_layer_gradient_bytes`;
- the gradients in flight (`eager_core_transient_bytes`): the probabilities' gradient in the softmax dtype (the
  `ToCopyBackward0` of the half cast makes it fp32), the softmax backward's output of the same size, the full-head
  gradient of v (`probs^T @ grad`, reduced to the kv heads only by repeat_kv's backward, which was made before
  the scores and so runs after the softmax chain), and the gradient of the layer's residual stream;
- under autocast, the half copies of the Linears whose backward has not run (q, k, v).
A checkpointed layer reaches this moment after its recompute, so it shows most there (the other layers' saved
tensors are not alive). Falcon's old architecture under sdpa (the math path) has its own moment
(`layer_tables.attention_backward_*`); under eager it is modelled here.
Sources: torch 2.13 `tools/autograd/derivatives.yaml` (`_softmax`: `_softmax_backward_data(grad, result, dim,
self.scalar_type())`; `bmm`; `_to_copy`), `torch/csrc/autograd/engine.cpp` (`ReadyQueue` ordered by sequence_nr),
`torch/csrc/autograd/input_buffer.cpp` (in-place accumulation of the residual gradient).
"""

from __future__ import annotations

from llmem.components.saved import Saved, _bytes, _sdpa
from llmem.components.sharding import local_numel
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec, per_spec

# Parameters whose backward runs after the attention core: the norm before attention and the q/k/v projections.
_BEFORE_CORE = ("q_proj", "k_proj", "v_proj", "query_key_value", "c_attn", "qkv_proj", "input_layernorm", "ln_1",
                "self_attn_layer_norm", "q_norm", "k_norm", "ln_attn")
# Saved tensors appended to a family's table after its MLP that belong to ops before the attention core (LoRA: what
# the q/k/v adapters keep, `lora_activations.layer_saved`).
_APPENDED_BEFORE = ("q_norm.", "k_norm.", "input_layernorm.(1+weight)", "q_proj/k_proj/v_proj")


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """A layer whose attention runs an eager matmul-softmax-matmul (the families' `eager_attention_forward`, and
    `FalconAttention`'s own branch in falcon's old architecture; falcon's sdpa path has its own moment in
    `layer_tables.attention_backward_*`). Not the quantized base of QLoRA (not modelled), nor a derived architecture
    (`llmem.derive`: its traced layer backward has every moment already)."""
    return plan.method is not Method.QLORA and not _sdpa(spec, plan) and spec.derived is None


def _falcon_old(spec: ModelSpec) -> bool:
    """Falcon's old architecture (one layernorm for the parallel attention and MLP, multi-query k and v)."""
    return spec.family.own_attention_core and not spec.options.get("new_decoder_architecture")


_SOFTMAX = ("softmax output", "attention probabilities (softmax)")  # `attention_saved`, falcon's old architecture
_V_OPERAND = ("eager v ", "value (matmul operand)")


def _softmax_index(items: tuple[Saved, ...]) -> int | None:
    return next((k for k, s in enumerate(items) if s.name.startswith(_SOFTMAX)), None)


def eager_core_released(spec: ModelSpec, plan: TrainingPlan, items: tuple[Saved, ...]) -> int:
    """Bytes of the layer's saved tensors (`items`, its table) already released at the softmax backward: those after
    the softmax output in the table (but the pre-attention ones a family appends last) and the v operand."""
    k = _softmax_index(items)
    if k is None:
        return 0
    after = [s for s in items[k + 1:] if not s.name.startswith(_APPENDED_BEFORE)]
    v = [s for s in items[:k] if s.name.startswith(_V_OPERAND)]
    # falcon's old architecture casts the layernorm output once for query_key_value and once for dense_h_to_4h
    # (autocast); the second went with the MLP's backward
    mlp_cast = sum(s.bytes for s in items[:k] if s.name.startswith("autocast input cast query_key_value, dense_"))
    return sum(s.bytes for s in after + v) + mlp_cast // 2


def _softmax_bytes(items: tuple[Saved, ...]) -> int:
    k = _softmax_index(items)
    return items[k].bytes if k is not None else 0


def eager_core_transient_bytes(spec: ModelSpec, plan: TrainingPlan, items: tuple[Saved, ...]) -> int:
    """The gradients in flight when `_softmax_backward_data` allocates its output: the probabilities' gradient and
    the softmax input's, each the softmax output's size (batch × heads × seq² in the softmax dtype); v's full-head
    gradient (tokens × heads·head_dim, compute dtype); the residual stream's gradient (tokens × h, param dtype).
    Falcon's old architecture: `at::matmul` sums v's gradient over the broadcast query heads inside its backward
    (tokens × kv width), and the MLP branch's gradient of the shared layernorm output (tokens × h, residual-stream
    dtype) waits for the attention branch's."""
    tokens = plan.batch_size * plan.seq_len
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim // plan.tp
    residual = tokens * spec.hidden_size * plan.precision.param_bytes
    if _falcon_old(spec):
        v = tokens * spec.num_kv_heads * spec.head_dim * cb
        return 2 * _softmax_bytes(items) + v + residual + tokens * spec.hidden_size * rb
    return 2 * _softmax_bytes(items) + tokens * q * cb + residual


@per_spec()
def layer_core_terms(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> tuple[int, int]:
    """(`eager_core_released`, `eager_core_transient_bytes`) on the layer's own table: LoRA's (`half`: half adapters,
    `lora.half_adapters`) or full fine-tuning's."""
    from llmem.components import activations as act
    from llmem.components import lora

    saved = lora.layer_saved(spec, plan, half=half) if lora.is_lora(plan) else act.layer_saved(spec, plan)
    return eager_core_released(spec, plan, saved), eager_core_transient_bytes(spec, plan, saved)


def _after_core(name: str) -> bool:
    return not any(f".{k}." in name or name.endswith(f".{k}") or f".{k}_" in name for k in _BEFORE_CORE)


@per_spec("layout_key")
def eager_core_layer_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, adapter_bytes: int | None = None) -> int:
    """The layer's weight gradients made before its attention core runs backward: those of every parameter but the
    pre-attention norm and the q/k/v projections (LoRA: of the adapters of the Linears after the core, fp32, or
    `adapter_bytes` each: FSDP2's half unsharded adapter gradients). `--ddp-bucket-view`, `--optimizer-in-backward`:
    none, each went into its bucket view when its AccumulateGrad ran, or was stepped and freed
    (`gradients.freed_at_hook`)."""
    from llmem.components import lora
    from llmem.components.gradients import freed_at_hook

    if freed_at_hook(plan):
        return 0
    if lora.is_lora(plan):
        after = [p for p in lora.layer0_targeted(spec, plan) if _after_core(p.name)]
        elem = adapter_bytes or lora.adapter_elem_bytes(spec)
        return sum(plan.lora_rank * sum(lora.in_out(spec, p)) for p in after) * elem
    params = spec.memo(("core.after",), lambda: tuple(p for p in spec.layer_params(0) if _after_core(p.name)))
    return sum(local_numel(p, plan) for p in params) * plan.precision.param_bytes


@per_spec("layout_key")
def eager_core_weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Under autocast: the half copies of the q/k/v Linears (their MmBackward0 has not run yet)."""
    from llmem.components.autocast import weight_copy_bytes

    return weight_copy_bytes(spec, plan, lambda name: not _after_core(name))



# --- The eager core's forward: the moment `_softmax` allocates its output (a checkpointed layer's first forward) ---


def forward_applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """transformers' `eager_attention_forward` after RoPE (llama-like families and gpt_neox): matmul, `* scaling`, the
    float mask added, `softmax(dtype=float32)`, cast back. Not gpt2's, opt's, bloom's, falcon's or gemma2's own
    eager programs (not modelled here), nor LoRA's tables."""
    f = spec.family
    return (applies(spec, plan) and f.rope and not (f.own_attention_core or f.sandwich_norms)
            and plan.method is Method.FULL)


def forward_softmax_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At `_softmax`: its input, the scores plus the mask (batch × heads × seq², the mask's residual-stream dtype wins
    the type promotion), and its fp32 output; from a half input a fp32 copy first (`at::softmax` with a dtype, torch
    2.13 `aten/src/ATen/native/SoftMax.cpp`). That source reads an fp16 input on a CUDA device in place
    (`_softmax(half_to_float=True)`); the fake-tensor simulation takes the copy for fp16 too, and so does this term
    (pure fp16: at most batch × heads × seq² × 4 bytes above a GPU, not checked on one)."""
    cb, rb = _bytes(plan)
    scores = plan.batch_size * spec.num_heads // plan.tp * plan.seq_len ** 2
    return scores * (rb + 4 + (4 if rb == 2 else 0))


def forward_intermediate_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The layer's forward tensors alive at the softmax when no op saves (a checkpointed layer's first forward): the
    input norm's output (tokens × h, residual-stream dtype), q and k after RoPE (RoPE's output dtype, the residual
    stream's: cos and sin take the hidden states' dtype), v (compute dtype; a fused qkv projection's whole output,
    which v views), and repeat_kv's copies of k and v (full heads) when the kv heads are fewer. transformers 5.23
    `models/llama/modeling_llama.py` (`LlamaAttention.forward`, `eager_attention_forward`, `repeat_kv`),
    `models/gpt_neox/modeling_gpt_neox.py` (`apply_rotary_pos_emb`: the rotated part cat the pass-through one)."""
    cb, rb = _bytes(plan)
    tokens = plan.batch_size * plan.seq_len
    q = tokens * spec.num_heads * spec.head_dim // plan.tp
    kv = tokens * spec.num_kv_heads * spec.head_dim // plan.tp
    fused = spec.family.fused_projections or spec.family.partial_rotary  # phi3's qkv_proj, gpt_neox's query_key_value
    v = (q + 2 * kv) * cb if fused else kv * cb
    repeated = q * (rb + cb) if spec.num_kv_heads < spec.num_heads else 0
    return tokens * spec.hidden_size * rb + (q + kv) * rb + v + repeated


def forward_later_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Under autocast: the half copies of the layer's Linears after the core, not yet made at its softmax."""
    from llmem.components.autocast import weight_copy_bytes

    return weight_copy_bytes(spec, plan, _after_core)


# --- bloom's attention in a checkpointed layer's recompute: its locals at the residual add ---


def recompute_locals_applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Full fine-tuning on the hand-written table, one device / DDP / ZeRO-1, of a family whose attention runs the
    residual add itself (`Family.attention_adds_residual`: `BloomAttention.forward`'s `dropout_add`), so the
    attention's locals outlive the output projection."""
    return spec.derived is None and plan.method is Method.FULL and plan.tp == 1 and spec.family.attention_adds_residual


def recompute_locals_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """A checkpointed bloom layer's recompute at the residual add inside `BloomAttention.forward` (transformers 5.23
    `modeling_bloom.py`): alive beside the saved tensors made so far are the block's locals — `layernorm_output`
    (tokens × h, residual dtype, until the post-attention norm rebinds it), `fused_qkv` (tokens × 3h, compute dtype;
    q, k and v are copies of its views), `alibi.baddbmm`'s scores (b × heads × s², compute dtype) and their sum with
    the float mask (the mask's dtype wins: the parameters'), and the output projection's output (tokens × h)."""
    cb, rb = _bytes(plan)
    tokens, h = plan.batch_size * plan.seq_len, spec.hidden_size
    scores = plan.batch_size * spec.num_heads * plan.seq_len ** 2
    return tokens * h * rb + tokens * 3 * h * cb + scores * (cb + max(cb, plan.precision.param_bytes)) + tokens * h * cb


def recompute_mlp_saved_bytes(spec: ModelSpec, plan: TrainingPlan, items: tuple[Saved, ...]) -> int:
    """Of the layer's saved tensors (`items`), those made after the residual add (the MLP's), not recomputed yet."""
    k = next((i for i, s in enumerate(items) if s.name.startswith("residual after attention")), len(items))
    return sum(s.bytes for s in items[k + 1:])


@per_spec("layout_key")
def recompute_weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Under autocast: the recompute's half copies of the attention's Linears (cached until it ends)."""
    from llmem.components.autocast import weight_copy_bytes

    return weight_copy_bytes(spec, plan, lambda name: ".self_attention." in name)


# --- falcon's eager core in a checkpointed layer's recompute: its locals at the softmax ---


def falcon_recompute_applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Falcon's old architecture under `--attn eager`, full fine-tuning on the hand-written table."""
    return _falcon_old(spec) and applies(spec, plan) and plan.method is Method.FULL


def falcon_recompute_locals_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """A checkpointed falcon layer's recompute when `F.softmax` allocates its output (`FalconAttention.forward`,
    transformers 5.23 `modeling_falcon.py` lines 311-352): beside the saved tensors made so far, its locals that
    nothing saves — `fused_qkv` (compute dtype; q is a view of it, k and v index copies), the scores (compute dtype,
    scaled in place: `DivBackward0` by a scalar saves nothing) and their sum with the float mask (residual dtype);
    under autocast also the fp32 layernorm output and q and k after RoPE (their half casts are what the matmuls
    save)."""
    cb, rb = _bytes(plan)
    tokens, hd = plan.batch_size * plan.seq_len, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    scores = plan.batch_size * spec.num_heads * plan.seq_len ** 2
    fp32_locals = (tokens * spec.hidden_size + tokens * q + tokens * kv) * rb if plan.precision.is_mixed else 0
    return tokens * (q + 2 * kv) * cb + scores * (cb + rb) + fp32_locals


def falcon_recompute_later_bytes(items: tuple[Saved, ...]) -> int:
    """Of a falcon layer's saved tensors (`items`), those made after its softmax (not recomputed yet)."""
    k = _softmax_index(items)
    return 0 if k is None else sum(s.bytes for s in items[k + 1:])
