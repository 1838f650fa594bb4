"""Activations: the tensors a decoder layer's forward keeps alive for its backward (autograd saved tensors).

Each entry is one tensor the real step allocates, named after the op that allocates it, sized per token
(tokens = micro-batch × seq_len) — read from transformers 5.23.0 `modeling_llama.py` and the autograd formulas
of the ops (a mul saves the operand the other's gradient needs; `.to()` and `+` save nothing).

Llama-family layer, sdpa (cb = compute-dtype bytes, rb = residual-stream bytes: 4 for fp32 and mixed, 2 for pure):
  RMSNorm   fp32 input copy (pure half only) 4h, rsqrt 4, normalized h*rb|2h, weight*x output (not under autocast)
  attention q_embed, k_embed (RoPE output), v, sdpa output: (2q + 2kv)*cb; sdpa logsumexp: heads*4
  eager     + scores and probabilities, 2 * heads * seq * 4 bytes (fp32 softmax), repeat_kv copies of k and v
  MLP       gate, silu(gate), up, silu*up: 4i*cb
  autocast  (mixed) each Linear casts its input to the half dtype: q, k, v, gate, up: 5 copies of h*2
The residual stream (layer input) is saved by the next RMSNorm's pow when it is already fp32 (fp32, mixed).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from itertools import accumulate

from llmem.components.layer_tables import (  # noqa: F401 (re-exported)
    _TABLES,
    attention_backward_freed_bytes,
    attention_backward_transient_bytes,
    falcon_math_attention,
    llama_family_saved,
    moe_routing_weight_bytes,
    moe_saved,
)
from llmem.components.saved import (  # noqa: F401 (re-exported)
    FP32,
    Saved,
    _bytes,
    _p,
    _proj_dim,
    _sdpa,
    dropout_saved,
    rms_norm_saved,
)
from llmem.plan import Device, GradCkpt, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def layer_saved(spec: ModelSpec, plan: TrainingPlan) -> tuple[Saved, ...]:
    """One decoder layer's saved tensors (its family's table). The walks ask for it many times per estimate, so it
    is kept per spec and plan (both immutable)."""
    return spec.memo(("layer_saved", plan.key), lambda: _layer_saved(spec, plan), per_plan=True)


def _layer_saved(spec: ModelSpec, plan: TrainingPlan) -> tuple[Saved, ...]:
    if spec.derived is not None:  # traced from transformers (`llmem.derive`)
        return tuple(spec.derived.layer_saved(plan))
    table = _TABLES.get(spec.model_type, llama_family_saved)
    return tuple(table(spec, plan, plan.batch_size * plan.seq_len, plan.seq_len))


def layer_activation_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Bytes one decoder layer keeps for backward without checkpointing."""
    return spec.memo(("layer_activation_bytes", plan.key), lambda: sum(s.bytes for s in layer_saved(spec, plan)),
                     per_plan=True)


def checkpointed_layer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """With checkpointing (`use_reentrant=False`), a layer keeps only its input hidden states."""
    _, rb = _bytes(plan)
    return plan.batch_size * plan.seq_len * spec.hidden_size * rb


@per_spec()
def checkpointed_input_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Full checkpointing: the checkpoint keeps the layer's input (tokens × h × rb), alive through the layer's
    recompute and backward. `layer_saved` lists it where an op of the layer saves it too (the fp32 residual stream,
    a LayerNorm's input); in pure half precision an RMSNorm saves its fp32 copy instead, so the input is extra."""
    if not checkpoints_layers(plan) or saves_layer_input(spec, plan):
        return 0
    return checkpointed_layer_bytes(spec, plan)


@per_spec()
def saves_layer_input(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether an op of the layer saves the layer's input (`layer_saved` lists the residual stream)."""
    return any(s.name.startswith("input (residual stream") for s in layer_saved(spec, plan))


# `torch.get_rng_state()`: the CPU generator's state as a uint8 tensor (mt19937 state + normal-sampling cache).
CPU_RNG_STATE_BYTES = 5056


def checkpoint_rng_state_bytes(plan: TrainingPlan) -> int:
    """`torch.utils.checkpoint` (`use_reentrant=False`, `preserve_rng_state=True`, the default) stashes
    `fwd_cpu_state = torch.get_rng_state()` at each checkpointed layer's forward, kept by the checkpoint frame until
    the layer's backward has run. It is a CPU tensor on every device (the CUDA generators' states it also saves are
    CPU tensors too), so only the cpu profile counts it. The recompute stashes another copy whose release is not
    tied to the layer's backward; it is not modelled."""
    return CPU_RNG_STATE_BYTES if plan.grad_ckpt is GradCkpt.FULL and plan.device is Device.CPU else 0


# The dropout on the MLP's output, the layer's last op before the residual add (gpt2 `resid_pdrop`, OPT `dropout`
# after fc2, phi3 `resid_mlp_dropout`, bloom/falcon `dropout_add`).
_MLP_OUTPUT_DROPOUTS = ("mlp dropout", "fc2 output dropout", "resid_mlp_dropout", "post_mlp_dropout",
                        "mlp dropout_add")


@per_spec()
def mlp_output_dropout_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """What the dropout on the MLP output saved (CPU: its noise; CUDA: its bool mask). Its backward is the first
    node of the layer's backward, and autograd releases a node's saved tensors once it ran, so this is gone before
    the layer's backward reaches its MLP peak (the `backward (layer ...)` moments)."""
    return sum(s.bytes for s in layer_saved(spec, plan) if s.name.startswith(_MLP_OUTPUT_DROPOUTS))


def checkpoints_layers(plan: TrainingPlan) -> bool:
    """Whether the decoder layers run under `torch.utils.checkpoint` (full, or selective: `llmem.runtime.selective`)."""
    return plan.grad_ckpt in (GradCkpt.FULL, GradCkpt.SELECTIVE)


def selective_saved(spec: ModelSpec, plan: TrainingPlan):
    """`--grad-ckpt selective`: one layer's outputs the policy saves (`llmem.derive.selective.saved_outputs`, traced
    at the plan's micro-batch, precision and attention)."""
    from llmem.derive.selective import saved_outputs

    def trace():
        mixed = plan.precision.compute_dtype_name if plan.precision.is_mixed else None
        return saved_outputs(spec.source_config, plan.precision.torch_dtype_name, _attn_name(spec, plan), mixed,
                             plan.batch_size, plan.seq_len)

    return spec.memo(("selective_saved", plan.key), trace, per_plan=True)


def _attn_name(spec: ModelSpec, plan: TrainingPlan) -> str:
    return "sdpa" if _sdpa(spec, plan) else "eager"


def kept_per_layer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """What a layer keeps from forward to backward: checkpointed, its input (full: and its RNG state; selective: and
    the outputs the policy saves, `selective_saved`); otherwise its saved tensors."""
    if plan.grad_ckpt is GradCkpt.SELECTIVE:
        return checkpointed_layer_bytes(spec, plan) + selective_saved(spec, plan).total
    if plan.grad_ckpt is GradCkpt.FULL:
        return checkpointed_layer_bytes(spec, plan) + checkpoint_rng_state_bytes(plan)
    return layer_activation_bytes(spec, plan)


def layer_plan(plan: TrainingPlan, layer: int) -> TrainingPlan:
    """The plan as decoder layer `layer` sees it: `--ckpt-every K` checkpoints the layers with index % K == 0; the
    others run exactly as without checkpointing (same saved tensors, same backward), so their terms are those of
    the plan with `--grad-ckpt none`."""
    if plan.grad_ckpt is not GradCkpt.FULL or plan.ckpt_every == 1:
        return plan
    return plan if plan.checkpointed(layer) else _uncheckpointed(plan)


@lru_cache(maxsize=64)
def _uncheckpointed(plan: TrainingPlan) -> TrainingPlan:
    return plan.with_(grad_ckpt=GradCkpt.NONE, ckpt_every=1)


def checkpointed_layer_count(spec: ModelSpec, plan: TrainingPlan) -> int:
    """How many decoder layers are checkpointed (and recomputed in backward): ceil(L / K) with --grad-ckpt full."""
    if plan.grad_ckpt is not GradCkpt.FULL:
        return 0
    return -(-spec.num_layers // plan.ckpt_every)


def varied(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether the decoder layers are of several kinds: a derived architecture's (`Derived.layer_kinds`, e.g.
    Gemma 3's sliding-window and full-attention layers). The hand-written families' layers are uniform.
    With `--ckpt-every K` > 1 the uncheckpointed layers answer from the tables of the plan without checkpointing
    (`layer_plan`), whose layers may be of several kinds where the checkpointed plan's are not: traced LoRA without
    checkpointing has a layer 0 of its own (its input needs no gradient, `llmem.derive.lora`), so layer 1 must be
    looked up as layer 1 there, not as the spec's first layer."""
    if spec.derived is None:
        return False
    plans = {plan, layer_plan(plan, 1)}
    return any(len(set(spec.derived.layer_kinds(p))) > 1 for p in plans)


def layer_spec(spec: ModelSpec, plan: TrainingPlan, layer: int) -> ModelSpec:
    """The spec as decoder layer `layer` sees it: where the layers are of several kinds (`varied`), the spec whose
    derived tables answer for that layer (`Derived.at`: its kind's saved tensors and backward); else the spec."""
    if not varied(spec, plan) or spec.derived.layer == layer:
        return spec
    return spec.memo(("layer_spec", layer), lambda: replace(spec, derived=spec.derived.at(layer)))


def kept_layer_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """What decoder layer `layer` keeps from forward to backward (`kept_per_layer_bytes` of its kind and its
    checkpointing)."""
    return kept_per_layer_bytes(layer_spec(spec, plan, layer), layer_plan(plan, layer))


@per_spec()
def kept_layers_bytes(spec: ModelSpec, plan: TrainingPlan, count: int) -> int:
    """What decoder layers 0 .. count-1 keep from forward to backward: a checkpointed layer its input
    (`checkpointed_layer_bytes`), any other its full `layer_activation_bytes`. With --ckpt-every K > 1, layer l's
    input is the previous layer's residual-add output, which that layer does not save itself, so the two kinds
    add up without overlap. Layers of several kinds (`varied`): the sum of each layer's `kept_layer_bytes`."""
    if varied(spec, plan):
        from llmem.derive.periodic import per_signature  # (each kind evaluated once)
        return spec.memo(("kept_layers", plan.key), lambda: list(accumulate(per_signature(
            spec, plan, lambda layer: kept_layer_bytes(spec, plan, layer)), initial=0)), per_plan=True)[count]
    if plan.ckpt_every == 1 or plan.grad_ckpt is not GradCkpt.FULL:
        return count * kept_per_layer_bytes(spec, plan)
    ckpt = -(-count // plan.ckpt_every)  # layers 0, K, 2K, ... below `count`
    full = layer_activation_bytes(spec, layer_plan(plan, 1))
    return ckpt * (checkpointed_layer_bytes(spec, plan) + checkpoint_rng_state_bytes(plan)) + (count - ckpt) * full


@per_spec()
def current_layer_backward_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """What layer `layer` holds while its own backward runs: checkpointed, its input plus everything the recompute
    saves again (`layer_activation_bytes` + `checkpointed_input_extra_bytes`) and its forward RNG state
    (`checkpoint_rng_state_bytes`); otherwise its saved tensors. Of its kind (`layer_spec`)."""
    lp, spec = layer_plan(plan, layer), layer_spec(spec, plan, layer)
    if checkpoints_layers(lp):
        return recompute_bytes(spec, lp)
    return layer_activation_bytes(spec, lp)


@per_spec()
def recompute_bytes(spec: ModelSpec, plan: TrainingPlan, saved: int | None = None) -> int:
    """A checkpointed layer during its backward: what its recompute saved (`saved`, default the layer's
    `layer_activation_bytes` + `checkpointed_input_extra_bytes`) and its forward RNG state, still held; selective:
    beside them the policy's saved outputs its recompute never reaches and no op saves (`selective_saved`)."""
    if saved is None:
        saved = layer_activation_bytes(spec, plan) + checkpointed_input_extra_bytes(spec, plan)
    if plan.grad_ckpt is GradCkpt.SELECTIVE:
        saved += selective_saved(spec, plan).extra
    return saved + checkpoint_rng_state_bytes(plan)


def backward_layers(spec: ModelSpec, plan: TrainingPlan, edge: int = 1) -> list[int]:
    """Decoder layers whose backward the walk evaluates, last first. With identical layers the live total is linear
    in the layer index between the `edge` outermost layers at each end, so those suffice.

    With --ckpt-every K > 1 the pattern of kept bytes and gradients repeats every K layers, so the K (+ edge - 1)
    layers at each end hold the extremes (every residue class mod K has its first and last layer there). Inside
    those two spans the total is also linear along each run of consecutive layers that are neither checkpointed
    nor among the `edge` outermost (a layer of such a run keeps one more uncheckpointed layer below it than its
    predecessor, and its gradients one layer fewer above; everything else is the same): a run's largest value,
    and the first of equal ones in the walk's last-first order, is at one of its two ends. So only the run ends
    are evaluated, next to the checkpointed and outermost layers — O(1) layers per plan instead of 2K, the same
    peak and peak phase (tests/test_ckpt_walk.py compares with the full spans).

    Layers of several kinds (`varied`): linear along each residue class of their period (`llmem.derive.periodic`)."""
    n = spec.num_layers
    if varied(spec, plan):
        from llmem.derive import periodic
        return periodic.backward_layers(spec, plan, edge)
    if plan.grad_ckpt is not GradCkpt.FULL or plan.ckpt_every == 1:
        return sorted({*range(min(edge, n)), *range(max(n - edge, 0), n)}, reverse=True)
    k = plan.ckpt_every
    span = k + edge - 1
    low, high = min(span, n), max(n - span, 0)  # the spans: [0, low) and [high, n)

    def inside(layer: int) -> bool:
        return 0 <= layer < low or high <= layer < n

    def breaks(layer: int) -> bool:  # a layer that ends a linear run (or lies outside the spans)
        return not inside(layer) or layer < edge or layer >= n - edge or layer % k == 0

    # the layers next to a break: the outermost, the checkpointed ones in the spans, the spans' own ends
    near = {*range(edge + 1), *range(n - edge - 1, n), low - 1, low, high - 1, high,
            *range(0, low, k), *range(-(-high // k) * k, n, k)}
    near |= {x + d for x in near for d in (-1, 1)}
    return sorted((x for x in near if inside(x) and (breaks(x) or breaks(x - 1) or breaks(x + 1))), reverse=True)


def final_norm_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """The final norm and what the lm_head saves of its input: the last layer's output (saved by the norm: LayerNorm
    always, RMSNorm when fp32 — under pure half its fp32 copy is in `rms_norm_saved`), the norm's statistics, and the
    lm_head's input (the norm output, or its autocast cast to half under mixed precision: tokens*h*cb either way).
    OPT with word_embed_proj_dim != hidden: project_out saves the norm output and the lm_head its output."""
    if spec.derived is not None:
        return spec.derived.final_saved(plan)
    tokens = plan.batch_size * plan.seq_len
    h = spec.hidden_size
    cb, rb = _bytes(plan)
    layer = spec.family.norm == "layer"
    items = []
    if rb == 4 or layer:
        items.append(Saved("last layer output (final norm input)", tokens * h * rb))
    if layer:
        items += [Saved("final norm.mean", tokens * FP32), Saved("final norm.rstd", tokens * FP32)]
    else:
        items += rms_norm_saved("final norm", spec, plan, tokens, output_saved=False)
        if spec.family.unit_offset_norm:
            items = [Saved(s.name, tokens * h * FP32) if s.name.endswith(".normalized") else s for s in items]
            items.append(Saved("final norm.(1+weight) fp32", h * FP32))
    items.append(Saved("lm_head input (final norm output or its autocast cast)", tokens * h * cb))
    proj = _proj_dim(spec)
    if spec.family.embed_projection and proj != h:
        items.append(Saved("project_out output (lm_head input)", tokens * proj * cb))
    return items


@per_spec()
def final_norm_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(s.bytes for s in final_norm_saved(spec, plan))


def outer_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """Outside the decoder layers, before them (alive until the embedding's backward):
    the step's input_ids (also the labels; allocated before the peak reset, int64);
    RoPE cos and sin (`*RotaryEmbedding`, position_ids of batch 1: seq × rotary dim, in the hidden states' dtype;
    gpt_neox rotates rotary_pct of head_dim);
    gpt2: wpe's position ids (1 × seq int64) and embd_pdrop's dropout; opt: position ids (batch × seq int64) and
    project_in's input when word_embed_proj_dim != hidden; gpt_neox: emb_dropout (hidden_dropout); phi3: embd_pdrop;
    bloom: word_embeddings_layernorm's input (the embedding output), mean and rstd (gemma's √h normalizer is its
    `embed_scale` buffer, saved as is: `components.buffers`).
    The embeddings' output that enters layer 0 is that layer's input (`layer_saved`). A derived architecture's
    are traced (`llmem.derive`)."""
    if spec.derived is not None:
        return [*spec.derived.outer_saved(plan), *checkpoint_held_saved(spec, plan)]
    _, rb = _bytes(plan)
    cb, _ = _bytes(plan)
    tokens, seq, h = plan.batch_size * plan.seq_len, plan.seq_len, spec.hidden_size
    family = spec.family
    items = [Saved("input_ids (labels)", tokens * 8)]
    if family.rope:
        rot = spec.head_dim
        if family.partial_rotary:
            rot = int(spec.head_dim * (_p(spec, "rotary_pct") if spec.options.get("rotary_pct") is not None else 1))
        items.append(Saved("RoPE cos, sin", 2 * seq * rot * rb))
    if family.learned_positions:
        items.append(Saved(f"{family.learned_positions} position ids",
                           (tokens if family.batched_position_ids else seq) * 8))
    if family.embed_projection and (proj := _proj_dim(spec)) != h:
        items.append(Saved("project_in input (embeddings)", tokens * proj * cb))
    if family.embedding_dropout:
        module, key = family.embedding_dropout
        items += dropout_saved(module, plan, tokens * h, rb, _p(spec, key))
    if family.embedding_norm:
        items += [Saved("word_embeddings_layernorm input", tokens * h * rb),
                  Saved("word_embeddings_layernorm.mean", tokens * FP32),
                  Saved("word_embeddings_layernorm.rstd", tokens * FP32)]
    items += checkpoint_held_saved(spec, plan)
    return items


@per_spec()
def outer_saved_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(s.bytes for s in outer_saved(spec, plan))


# What checkpointed layers hold beyond their saved tensors lives in its own module (it reads this one's terms).
from llmem.components.checkpoint_held import (  # noqa: E402, F401 (re-exported)
    checkpoint_held_saved,
    eager_mask_held_saved,
    eager_mask_released_bytes,
)
