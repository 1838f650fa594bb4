"""Per-family tables of what one decoder layer's forward keeps for backward (autograd saved tensors), read from
transformers 5.23's modeling files: llama and its relatives, gpt2, opt, gpt_neox, falcon, bloom, and the grouped-
experts MoE block. Built from `llmem.components.saved`; chosen by `llmem.components.activations.layer_saved`.
"""

from __future__ import annotations

from llmem.components import quant_autocast
from llmem.components.saved import (
    FP32,
    Saved,
    _bytes,
    _cast,
    _flash,
    _p,
    attention_saved,
    dropout_saved,
    layer_norm_saved,
    rms_norm_saved,
)
from llmem.components.sharding import FSDP_SCHEMES
from llmem.plan import Attention, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def llama_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """Saved tensors of one llama-family decoder layer on one rank (TP shards heads and intermediate)."""
    h, tp = spec.hidden_size, plan.tp
    q = spec.num_heads * spec.head_dim // tp
    kv = spec.num_kv_heads * spec.head_dim // tp
    i = spec.intermediate_size // tp
    cb, rb = _bytes(plan)
    mixed = plan.precision.is_mixed
    items: list[Saved] = []
    if rb == 4:
        items.append(Saved("input (residual stream)", tokens * h * rb))
    items += rms_norm_saved("input_layernorm", spec, plan, tokens, output_saved=not mixed)
    if mixed:
        items.append(Saved("autocast input casts q/k/v", 3 * tokens * h * 2))
    sdpa_inputs = [Saved("q_embed (RoPE)", tokens * q * cb), Saved("k_embed (RoPE)", tokens * kv * cb),
                   Saved("v_proj", tokens * kv * cb)]
    # phi3's qkv_proj: v views it unless repeat_kv copies (fewer kv heads)
    fused_v = tokens * (q + 2 * kv) * cb if spec.family.fused_projections and kv == q else 0
    # one kv head: repeat_kv's copy is a stride-0 view at micro-batch 1 (k's is cast to half under autocast: a copy)
    one_kv = tokens * kv * cb if kv == spec.head_dim and kv < q else 0
    autocast = mixed and plan.scheme not in FSDP_SCHEMES  # FSDP2 runs no autocast
    items += attention_saved(spec, plan, tokens, seq, sdpa_inputs, _p(spec, "attention_dropout"), output_copy=False,
                             softcap=bool(spec.options.get("attn_logit_softcapping")), fused_v_bytes=fused_v,
                             kv_view_bytes=(0 if autocast else one_kv, one_kv))
    if rb == 4:
        items.append(Saved("residual after attention", tokens * h * rb))
    items += rms_norm_saved("post_attention_layernorm", spec, plan, tokens, output_saved=not mixed)
    if mixed:
        items.append(Saved("autocast input casts gate/up", 2 * tokens * h * 2))
    items += [
        Saved("gate_proj", tokens * i * cb),
        Saved("silu(gate)", tokens * i * cb),
        Saved("up_proj", tokens * i * cb),
        Saved("silu(gate) * up", tokens * i * cb),
    ]
    return items




def gpt2_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/gpt2/modeling_gpt2.py: GPT2Block`. Conv1D is `addmm(bias, x, W)`; with a fused sdpa kernel c_attn's
    (tokens, 3h) output stays alive through the q/k/v views sdpa saves (the output's reshape is a view, c_proj's
    input); eager and the CPU math path copy q/k/v instead (`attention_saved`). attn_pdrop on the
    probabilities, resid_pdrop after c_proj (attention) and after the MLP. GPT2MLP's gelu_new
    0.5*x*(1+tanh(c*(x+0.044715*x^3))) saves x, 0.5*x, tanh, 1+tanh, and the product (c_proj's input): 5 × inner."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    resid = _p(spec, "resid_pdrop")
    return [
        Saved("input (residual stream, ln_1 input)", tokens * h * rb),
        *layer_norm_saved("ln_1", plan, tokens, h), *_cast(plan, tokens, h, 1, "c_attn"),
        *attention_saved(spec, plan, tokens, seq, [Saved("c_attn output (q, k, v views)", tokens * 3 * q * cb)],
                         _p(spec, "attn_pdrop"), output_copy=False, softmax_in_input_dtype=True,
                         fused_v_bytes=tokens * 3 * q * cb, fused_qk_views=True),
        *dropout_saved("resid_dropout (attention)", plan, tokens * h, cb, resid),
        Saved("residual after attention (ln_2 input)", tokens * h * rb),
        *layer_norm_saved("ln_2", plan, tokens, h), *_cast(plan, tokens, h, 1, "c_fc"),
        Saved("c_fc output x (pow input)", tokens * i * cb), Saved("gelu_new 0.5*x", tokens * i * cb),
        Saved("gelu_new tanh output", tokens * i * cb), Saved("gelu_new 1+tanh", tokens * i * cb),
        Saved("gelu_new product (c_proj input)", tokens * i * cb),
        *dropout_saved("mlp dropout", plan, tokens * h, cb, resid),
    ]


def opt_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/opt/modeling_opt.py: OPTDecoderLayer` (pre-LN): q_proj(x)*scaling, k, v saved by sdpa (its output is
    out_proj's input); `dropout` after out_proj and after fc2, `attention_dropout` on the probabilities; relu saves
    its output (fc2's input) only."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    p = _p(spec, "dropout")
    return [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("self_attn_layer_norm", plan, tokens, h), *_cast(plan, tokens, h, 3, "q/k/v"),
        *attention_saved(spec, plan, tokens, seq, [Saved("q_proj * scaling", tokens * q * cb),
                                                   Saved("k_proj", tokens * q * cb), Saved("v_proj", tokens * q * cb)],
                         _p(spec, "attention_dropout"), output_copy=False),
        *dropout_saved("attention output", plan, tokens * h, cb, p),
        Saved("residual after attention", tokens * h * rb),
        *layer_norm_saved("final_layer_norm", plan, tokens, h), *_cast(plan, tokens, h, 1, "fc1"),
        Saved("relu(fc1) output", tokens * i * cb),
        *dropout_saved("fc2 output", plan, tokens * h, cb, p),
    ]


def neox_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/gpt_neox/modeling_gpt_neox.py: GPTNeoXLayer` (parallel residual): with a fused sdpa kernel the
    query_key_value output stays alive (v is a view of it) with the partial rotary `cat(rotated, pass)` copies of q
    and k; the attention output's contiguous reshape is dense's input; hidden_dropout after dense and after the
    MLP, attention_dropout on the probabilities; gelu saves the h_to_4h output and dense_4h_to_h its output."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    hidden = _p(spec, "hidden_dropout")
    items = [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("input_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "query_key_value"),
        *attention_saved(spec, plan, tokens, seq, [
            Saved("query_key_value output", tokens * 3 * q * cb),
            Saved("q rotary cat", tokens * q * cb), Saved("k rotary cat", tokens * q * cb)],
            _p(spec, "attention_dropout"), fused_v_bytes=tokens * 3 * q * cb),
        *dropout_saved("post_attention_dropout", plan, tokens * h, cb, hidden),
    ]
    if spec.options.get("use_parallel_residual") is False:
        items.append(Saved("residual after attention", tokens * h * rb))
    return items + [
        *layer_norm_saved("post_attention_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "dense_h_to_4h"),
        Saved("dense_h_to_4h output (gelu input)", tokens * i * cb), Saved("gelu output", tokens * i * cb),
        *dropout_saved("post_mlp_dropout", plan, tokens * h, cb, hidden),
    ]


def falcon_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/falcon/modeling_falcon.py: FalconDecoderLayer` (parallel attention). Old architecture (multi-query):
    sdpa with an explicit mask runs the math path in both attention modes (q, k, v operands as in
    `_falcon_math_sdpa_operands`, fp32 probabilities); new architecture: RoPE q and k (k expanded to all heads), v,
    sdpa; eager as `attention_saved`. MLP: dense_h_to_4h output and gelu output. `dropout_add` applies
    hidden_dropout once per parallel layer (twice otherwise), attention_dropout on the probabilities.
    Checked in fp32 (real runs) and, old architecture, bf16 / bf16-mixed at full size (simulation); the
    non-parallel layout reuses these terms."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q, heads = spec.num_heads * spec.head_dim, spec.num_heads
    kv = spec.num_kv_heads * spec.head_dim
    new = bool(spec.options.get("new_decoder_architecture"))
    parallel = spec.options.get("parallel_attn", True)
    items = [Saved("input (residual stream)", tokens * h * rb)]
    items += layer_norm_saved("ln_attn" if new else "input_layernorm", plan, tokens, h)
    if new:
        items += layer_norm_saved("ln_mlp", plan, tokens, h)
    items += _cast(plan, tokens, h, 2, "query_key_value, dense_h_to_4h")
    if new:
        items += attention_saved(spec, plan, tokens, seq, [
            Saved("query (RoPE)", tokens * q * cb), Saved("key (RoPE)", tokens * q * cb),
            Saved("key expanded to all heads", tokens * q * cb), Saved("value", tokens * kv * cb)],
            _p(spec, "attention_dropout"), output_copy=False)
    else:
        math = plan.attn is Attention.SDPA
        items += [Saved("query_key_value split indices [-2], [-1] (int64)", 16),
                  *(_falcon_math_sdpa_operands if math else _falcon_eager_operands)(spec, plan, tokens),
                  # eager: softmax(dtype=hidden_states.dtype), the layernorm output's: fp32 under autocast
                  Saved("attention probabilities (softmax)", tokens * heads * seq * (FP32 if math else rb)),
                  Saved("attention output", tokens * q * cb)]
        if not math and plan.precision.is_mixed:  # autocast casts them to half for `@ value`, which keeps the cast
            items.append(Saved("attention probabilities cast to half (matmul operand)", tokens * heads * seq * cb))
    hidden = _p(spec, "hidden_dropout")
    if not parallel:
        items += [*dropout_saved("attention dropout_add", plan, tokens * h, cb, hidden),
                  Saved("residual after attention", tokens * h * rb),
                  *layer_norm_saved("post_attention_layernorm", plan, tokens, h)]
    return items + [Saved("dense_h_to_4h output (gelu input)", tokens * i * cb), Saved("gelu output", tokens * i * cb),
                    *dropout_saved("mlp dropout_add", plan, tokens * h, cb, hidden)]


def _falcon_math_sdpa_operands(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """The q, k, v bmm operands `_scaled_dot_product_attention_math` saves for falcon's old architecture (k and v
    with num_kv_heads heads, no `enable_gqa`: `at::matmul` broadcasts them over the query heads). Half inputs are
    upcast to fp32 first (q*sqrt(scale), k*sqrt(scale), v.to(float32)); the broadcast k and v stay stride-0 views
    of their kv-head tensors when the micro-batch is 1 (the expanded batch and head dims merge into one bmm batch
    dim) and are copied to all heads otherwise. fp32 inputs: no upcast, the same operands in fp32 (the stride-0 view
    at micro-batch 1 measured too: `at::matmul`'s expand + reshape to the bmm batch is a view when b = 1)."""
    cb, _ = _bytes(plan)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    k_width = kv if plan.batch_size == 1 else q
    if cb == FP32:
        return [Saved("query scaled (math sdpa)", tokens * q * cb),
                Saved("key expanded, scaled", tokens * k_width * cb), Saved("value expanded", tokens * k_width * cb)]
    return [Saved("math sdpa q*sqrt(scale) (fp32)", tokens * q * FP32),
            Saved("math sdpa k*sqrt(scale) (fp32 bmm operand)", tokens * k_width * FP32),
            Saved("math sdpa v.to(float32) (bmm operand)", tokens * k_width * FP32)]


def _falcon_eager_operands(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """`FalconAttention.forward`'s eager branch (old architecture, `--attn eager`): `query @ key.transpose(-1, -2)`
    and `softmax(...) @ value` in the compute dtype; `at::matmul` broadcasts k and v from their kv heads to the
    query heads, a stride-0 view at micro-batch 1 and a copy otherwise (as in `_falcon_math_sdpa_operands`); the
    scores are scaled in place and the mask added into a new tensor that softmax does not keep."""
    cb, _ = _bytes(plan)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    k_width = kv if plan.batch_size == 1 else q
    return [Saved("query (RoPE, matmul operand)", tokens * q * cb),
            Saved("key (matmul operand)", tokens * k_width * cb),
            Saved("value (matmul operand)", tokens * k_width * cb)]


def falcon_math_attention(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Falcon's old architecture with parallel attention under `--attn sdpa`: sdpa with an explicit mask runs the
    math path (`--attn eager` runs `FalconAttention`'s own matmul-softmax branch, `_falcon_eager_operands`)."""
    return (spec.family.own_attention_core and plan.attn is Attention.SDPA
            and not spec.options.get("new_decoder_architecture")
            and bool(spec.options.get("parallel_attn", True)))


@per_spec()
def attention_backward_freed_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Saved tensors of a falcon (math-path) layer already released when its softmax backward runs: the MLP's
    (dense_h_to_4h output, gelu output, and under autocast dense_h_to_4h's input cast) — the MLP ran last, so its
    backward runs first —, the attention output (saved by `dense`) and the v operand (released by the bmm
    backward)."""
    if not falcon_math_attention(spec, plan):
        return 0
    tokens = plan.batch_size * plan.seq_len
    cb, _ = _bytes(plan)
    i, q = spec.intermediate_size, spec.num_heads * spec.head_dim
    value = _falcon_math_sdpa_operands(spec, plan, tokens)[2].bytes
    mlp_cast = sum(s.bytes for s in _cast(plan, tokens, spec.hidden_size, 1, "dense_h_to_4h"))
    return 2 * tokens * i * cb + mlp_cast + tokens * q * cb + value


@per_spec()
def attention_backward_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Gradients alive in a falcon (math-path) layer when `_softmax_backward_data` allocates its output:
    that output and the probabilities' gradient from the `bmm` backward (fp32, batch × heads × seq² each, next to
    the saved probabilities), v's gradient (the bmm gradient summed over the broadcast heads, fp32 when upcast),
    the gradient of the layer output (held by the residual branch, param dtype) and the MLP branch's gradient of
    the layernorm output (residual-stream dtype), which waits for the attention branch's to be added to it."""
    if not falcon_math_attention(spec, plan):
        return 0
    tokens = plan.batch_size * plan.seq_len
    cb, rb = _bytes(plan)
    scores = tokens * spec.num_heads * plan.seq_len
    kv = spec.num_kv_heads * spec.head_dim
    v_grad = tokens * kv * (cb if cb == FP32 else FP32)
    return (2 * scores * FP32 + v_grad + tokens * spec.hidden_size * plan.precision.param_bytes
            + tokens * spec.hidden_size * rb)


def bloom_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/bloom/modeling_bloom.py: BloomBlock` (eager only): fused query_key_value split into q, k, v
    (baddbmm / bmm operands: `BloomAttention._reshape`'s transposed views reshaped to (b·heads, s, d), lines 213-267 —
    copies, but views of the one fused output at micro-batch 1, where b and heads merge), alibi `baddbmm`
    scores → fp32 softmax (cast back when half), context (dense input);
    hidden_dropout in both `dropout_add`s, attention_dropout on the probabilities; bloom_gelu_forward saves x and
    its output (4h MLP)."""
    h, i = spec.hidden_size, 4 * spec.hidden_size
    cb, rb = _bytes(plan)
    hidden = _p(spec, "hidden_dropout")
    return [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("input_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "query_key_value"),
        *attention_saved(spec, plan.with_(attn="eager"), tokens, seq, [], _p(spec, "attention_dropout"),
                         fused_v_bytes=tokens * 3 * h * cb, fused_qk_views=True),
        *dropout_saved("attention dropout_add", plan, tokens * h, cb, hidden),
        Saved("residual after attention", tokens * h * rb),
        *layer_norm_saved("post_attention_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "dense_h_to_4h"),
        Saved("dense_h_to_4h output", tokens * i * cb), Saved("bloom_gelu output", tokens * i * cb),
        *dropout_saved("mlp dropout_add", plan, tokens * h, cb, hidden),
    ]


def moe_routing_weight_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Element size of the routing weights the experts receive: `MixtralTopKRouter` returns the fp32 topk of its
    fp32 softmax; `Qwen2MoeTopKRouter` casts them back to the router logits' dtype (the compute dtype)."""
    return FP32 if spec.family.routing_weights_fp32 else plan.precision.compute_bytes


def moe_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """transformers 5 `MixtralSparseMoeBlock` / `Qwen2MoeSparseMoeBlock` with grouped experts: router softmax
    (fp32), top-k indices, routing weights, tokens sorted by expert and gathered (tokens × top_k rows), grouped
    gate_up output, silu, silu*up, down output (scaled by the routing weights), offsets and permutations.
    The experts compute in their weights' dtype, not autocast's: `integrations/moe.py: _grouped_mm` runs
    `grouped_mm(input.to(weight.dtype), weight)` (grouped mm is not autocast-enabled), so under mixed precision
    the gathered tokens (the fp32 layernorm output) and every expert tensor are fp32."""
    h, e, k = spec.hidden_size, spec.num_experts, spec.experts_per_token
    i = spec.moe_intermediate_size or spec.intermediate_size
    _, rb = _bytes(plan)
    cb = plan.precision.param_bytes  # the expert weights' dtype
    r = tokens * k
    items = [Saved("router softmax", tokens * e * FP32), Saved("topk indices", r * 8)]
    if spec.family.topk_renormalized or spec.options.get("norm_topk_prob"):
        items += [Saved("topk weight sum", tokens * FP32), Saved("normalized routing weights", r * FP32)]
    return items + [
        Saved("sorted expert ids", r * 8), Saved("sort permutation", r * 8),
        Saved("gathered tokens (tokens × top_k)", r * h * rb),
        Saved("gathered routing weights", r * moe_routing_weight_bytes(spec, plan)),
        Saved("expert offsets (cumsum)", e * FP32), Saved("grouped gate_up output", r * 2 * i * cb),
        Saved("silu(gate)", r * i * cb), Saved("silu(gate) * up", r * i * cb),
        Saved("grouped down_proj output", r * h * cb), Saved("inverse permutation", r * 8),
    ]


def llama_family_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """llama with the per-family differences of the llama-like decoders:
    phi3 `Phi3Attention`/`Phi3MLP`: fused qkv_proj (kept alive by the v view) and gate_up_proj (chunk views);
    qwen3 `Qwen3RMSNorm` q_norm/k_norm on (tokens, heads, head_dim) before RoPE;
    gemma `GemmaRMSNorm`: x.float() normalized * (1 + weight.float()) saves the fp32 (1+w) (h*4 per norm);
    mixtral/qwen2_moe: the MLP is replaced by `moe_saved` (+ qwen2_moe's shared expert and its sigmoid gate)."""
    items = llama_layer_saved(spec, plan, tokens, seq)
    cb, rb = _bytes(plan)
    family = spec.family
    q = spec.num_heads * spec.head_dim // plan.tp
    kv = spec.num_kv_heads * spec.head_dim // plan.tp
    h = spec.hidden_size
    if family.unit_offset_norm:
        # GemmaRMSNorm keeps its normalized product in fp32 (`output * (1 + weight.float())`, cast after)
        items = [Saved(s.name, tokens * h * FP32) if s.name.endswith(".normalized") else s for s in items]
        norms = ["input_layernorm", "post_attention_layernorm"]
        if family.sandwich_norms:
            # Gemma2DecoderLayer: post_attention_layernorm on the o_proj output and post_feedforward_layernorm on the
            # MLP output (their outputs go to the residual add, unsaved); x.float() (the fp32 input, a copy when
            # half) saved by pow/mul, rsqrt, fp32 normalized. The llama pre-MLP norm above is pre_feedforward.
            for n, what in (("post_attention_layernorm", "o_proj output"),
                            ("post_feedforward_layernorm", "mlp output")):
                items += [Saved(f"{n} input ({what}, fp32)", tokens * h * FP32), Saved(f"{n}.rsqrt", tokens * FP32),
                          Saved(f"{n}.normalized", tokens * h * FP32)]
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        items += [Saved(f"{n}.(1+weight) fp32", h * FP32) for n in norms]
    if family.qk_norm:
        # Qwen3RMSNorm on the q/k projection (cb): `x.to(float32)` (a copy unless fp32) saved by pow and by the
        # mul with rsqrt; `.normalized` = `(x * rsqrt).to(input_dtype)` (cb, a copy unless fp32) saved by
        # `weight * x`. The norm's output goes to RoPE, whose muls by cos/sin (no grad) do not save it.
        for name, width, n in (("q_norm", q, spec.num_heads // plan.tp), ("k_norm", kv, spec.num_kv_heads // plan.tp)):
            items += [Saved(f"{name}.rsqrt", tokens * n * FP32), Saved(f"{name}.input in fp32", tokens * width * FP32),
                      Saved(f"{name}.normalized", tokens * width * cb)]
    if family.fused_projections:
        items = _fused_projection_items(spec, plan, items, tokens)
    if family.residual_dropout:
        for n in ("resid_attn_dropout", "resid_mlp_dropout"):
            items += dropout_saved(n, plan, tokens * h, cb, _p(spec, "resid_pdrop"))
    if family.grouped_experts:
        mlp = ("gate_proj", "silu(gate)", "up_proj", "silu(gate) * up", "autocast input casts gate/up")
        items = [s for s in items if s.name not in mlp]
        items += moe_saved(spec, plan, tokens)
        if family.shared_expert and spec.shared_expert_intermediate_size:
            si = spec.shared_expert_intermediate_size
            items += _cast(plan, tokens, spec.hidden_size, 3, "shared gate/up, shared_expert_gate")
            items += [Saved(f"shared_expert {n}", tokens * si * cb)
                      for n in ("gate_proj", "silu(gate)", "up_proj", "silu(gate) * up")]
            items += [Saved("shared_expert output", tokens * spec.hidden_size * cb),
                      Saved("shared_expert_gate sigmoid", tokens * cb)]
        # the router's F.linear casts its input under autocast too (`Qwen2MoeTopKRouter.forward`, `MixtralTopKRouter`)
        items += _cast(plan, tokens, spec.hidden_size, 1, "router")
    return quant_autocast.fp32_output_items(items, plan)  # QLoRA under autocast: fp32 4-bit Linear outputs


def _fused_projection_items(spec: ModelSpec, plan: TrainingPlan, items: list[Saved], tokens: int) -> list[Saved]:
    """phi3's fused qkv_proj and gate_up_proj in place of llama's separate Linears: one autocast input cast per fused
    Linear, each where its Linear runs (the attention core's backward comes after gate_up_proj's and before
    qkv_proj's: `attention_core.eager_core_released` reads the order); sdpa keeps the qkv output through v's view."""
    cb, _ = _bytes(plan)
    q = spec.num_heads * spec.head_dim // plan.tp
    kv = spec.num_kv_heads * spec.head_dim // plan.tp
    fused_casts = {"autocast input casts q/k/v": "qkv_proj", "autocast input casts gate/up": "gate_up_proj"}
    items = [_cast(plan, tokens, spec.hidden_size, 1, fused_casts[s.name])[0] if s.name in fused_casts else s
             for s in items if s.name not in ("v_proj", "gate_proj", "up_proj")]
    if _flash(spec, plan):  # sdpa saves v as a view of the fused output; the output's transpose is not contiguous
        items += [Saved("qkv_proj output (v view kept)", tokens * (q + 2 * kv) * cb),
                  Saved("attention output contiguous (o_proj input)", tokens * q * cb)]
    return items + [Saved("gate_up_proj output", tokens * 2 * (spec.intermediate_size // plan.tp) * cb)]


_TABLES = {"gpt2": gpt2_layer_saved, "opt": opt_layer_saved, "gpt_neox": neox_layer_saved,
           "falcon": falcon_layer_saved, "bloom": bloom_layer_saved}


