"""LoRA on a grouped-experts MoE layer (mixtral, qwen2_moe) with the routed experts frozen (adapters on the
attention Linears and on qwen2_moe's shared expert, `all-linear` included: `moe_targets_refusal`): the candidate peaks
of its backward. The saved tensors are `lora_activations.layer_saved` (full fine-tuning's `layer_tables.moe_saved`
without `frozen_moe_dropped`). mixtral's `all-linear` adapts the router and experts too: `lora_experts`."""

from __future__ import annotations

from llmem.components import activations as act
from llmem.errors import GAP, InputError
from llmem.plan import ALL_LINEAR, GradCkpt, Method, Precision, Quant, TrainingPlan
from llmem.spec import ModelSpec

_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


# A grouped-experts MoE block with frozen experts, router and shared expert (transformers 5.23
# `MixtralSparseMoeBlock` / `Qwen2MoeSparseMoeBlock`): the entries of `layer_tables.moe_saved` (and qwen2_moe's
# shared expert) that only a weight gradient needed. `grouped_mm(x, w)` with a frozen `w` saves `w` alone (the input
# gradient is `grad @ w`); a frozen Linear under autocast saves its weight's copy, not its input's cast.
_FROZEN_MOE_DROPPED = frozenset({
    "gathered tokens (tokens × top_k)",  # the experts' gate_up grouped mm input
    "shared_expert silu(gate) * up",  # the shared expert's down_proj input
    "autocast input cast router", "autocast input cast shared gate/up, shared_expert_gate",
})


# qwen2_moe's MoE block (transformers 5.23 `modeling_qwen2_moe.py:339-350`): the shared expert's Linears and
# `shared_expert_gate` are `nn.Linear`s, which PEFT's `all-linear` adapts (`peft/tuners/tuners_utils.py:2447-2452`:
# every `nn.Linear` but the output layer); the router (`Qwen2MoeTopKRouter`, a bare parameter) and the fused experts
# are not Linears and stay frozen. Groups as `lora_activations._INPUT_GROUPS`: gate_proj, up_proj and
# shared_expert_gate read the same `hidden_states_reshaped` (h wide), down_proj reads `silu(gate) * up` (si wide);
# the full-fine-tuning entries they replace are in `_FROZEN_MOE_DROPPED`.
SHARED_EXPERT_GROUPS = (
    (("gate_proj", "up_proj", "shared_expert_gate"), "h", ("autocast input cast shared gate/up, shared_expert_gate",)),
    (("down_proj",), "si", ("shared_expert silu(gate) * up",)),
)

# Which of the shared expert's entries a LoRA layer saves follows whose output requires grad
# (`lora_activations._requires_grad`): in layer 0 without attention adapters (its input, so the residual, needs no
# gradient) only the shared expert's adapted Linears start a graph, and the routed experts save nothing. Ops as
# transformers 5.23 `modeling_qwen2_moe.py` runs them: `down(act(gate(x)) * up(x))`, then
# `sigmoid(shared_expert_gate(x)) * shared_out`; SiluBackward0 saves its input, a mul saves each operand for the
# other's gradient, SigmoidBackward0 its output.
SHARED_EXPERT_NEEDS = {
    "shared_expert gate_proj": "gate_proj",  # silu's input
    "shared_expert up_proj": "gate_proj",  # saved by the mul for silu(gate)'s gradient
    "shared_expert silu(gate)": "up_proj",  # ... and silu(gate) for up's
    "shared_expert output": "shared_expert_gate",  # saved by the gate mul for the sigmoid's gradient
    "shared_expert_gate sigmoid": "shared gate mul",  # by SigmoidBackward0, or by the mul for shared_out's gradient
    "silu(gate)": "residual",  # the routed experts' (the MLP names are the shared expert's here)
}


def moe_needs(spec: ModelSpec) -> dict[str, str]:
    return SHARED_EXPERT_NEEDS if spec.family.shared_expert else {}


def shared_expert_grad(spec: ModelSpec, grad: dict[str, bool], adapted) -> dict[str, bool]:
    """`lora_activations._requires_grad` with the shared expert's gate branch: `shared_expert_gate`'s output requires
    grad when the residual does or it is adapted; the gate mul saves when that or the shared output (down_proj's:
    its input requires grad, or down_proj is adapted) does."""
    if not spec.family.shared_expert:
        return grad
    gate = grad["residual"] or "shared_expert_gate" in adapted
    down = grad["down_proj input"] or "down_proj" in adapted
    return {**grad, "shared_expert_gate": gate, "shared gate mul": gate or down}


def frozen_moe_dropped(spec: ModelSpec) -> frozenset:
    """The full-fine-tuning MoE entries LoRA does not save (`_FROZEN_MOE_DROPPED`); none without grouped experts.
    An adapted shared expert keeps what its adapters need instead (`SHARED_EXPERT_GROUPS`); an adapted router or
    fused experts are refused (`moe_targets_refusal`)."""
    return _FROZEN_MOE_DROPPED if spec.family.grouped_experts else frozenset()


def moe_targets_refusal(spec: ModelSpec, plan: TrainingPlan) -> InputError | None:
    """LoRA on a grouped-experts MoE family: modelled with adapters on the attention Linears, or `all-linear`
    (qwen2_moe: also the shared expert's Linears and `shared_expert_gate`, `SHARED_EXPERT_GROUPS`; mixtral: also
    the router and fused experts, `lora_experts`), with sdpa or eager attention (layer 0's eager bmm operands:
    `lora_activations._EAGER_NEEDS`). Not modelled yet (`_targets_refusal`): other MoE-block targets, dense layers
    among the expert ones, QLoRA with the 8-bit base (+3.2 % on a tiny mixtral, not pinned down), and QLoRA on
    several GPUs beyond DDP (several GPUs measured on 2 ranks: DDP, ZeRO-1, FSDP2 ZeRO-2/3,
    `tests/components/test_lora_moe_multirank.py`)."""
    if not spec.family.grouped_experts:
        return None
    if not all(any(".experts." in p.name for p in spec.layer_params(i)) for i in range(spec.num_layers)):
        return InputError("mlp_only_layers", f"lora on {spec.model_type!r} with dense MLP layers among the expert "
                          "layers (mlp_only_layers, decoder_sparse_step > 1) is not modelled yet (+5 % on a tiny "
                          "qwen2_moe); use --method full", GAP)
    if plan.gpus > 1 and plan.method is Method.QLORA and plan.zero:
        return InputError("zero", f"qlora on {spec.model_type!r} (mixture of experts) on several GPUs is measured "
                          "with DDP only; use --zero 0 or --method lora", GAP)
    if plan.method is Method.QLORA and plan.quant is Quant.INT8:
        return InputError("quant", f"qlora with --quant int8 on {spec.model_type!r} (mixture of experts) is not "
                          "modelled yet; use --quant nf4 or fp4", GAP)
    if plan.method is Method.QLORA and plan.precision.is_mixed:  # measured -2.4 % (qwen2_moe), +6.0 % (mixtral)
        return InputError("precision", f"qlora with {plan.precision.value} on {spec.model_type!r} (mixture of "
                          f"experts) is not modelled yet (docs/MODEL-QLORA-MIXED.md); use --precision "
                          f"{plan.precision.pure} or --method lora", GAP)
    return _targets_refusal(spec, plan)


def _targets_refusal(spec: ModelSpec, plan: TrainingPlan) -> InputError | None:
    """Targets beyond the modelled ones. mixtral: PEFT rewrites the config for transformers 5's fused experts
    (`peft/utils/transformers_weight_conversion.py:44-45, 332-345, 369-373, 402-482`): `all-linear` (or w1/w2/w3,
    gate) then also adapts the router's `gate.weight` and the 3-D `experts.gate_up_proj` / `experts.down_proj`
    through `ParamWrapper` (`peft/tuners/lora/layer.py:2335`), whose forward materialises each adapted expert
    stack (`_LoraFactorsProxy`, `layer.py:2305-2323`), modelled for `all-linear` (`lora_experts`). qwen2_moe has
    no such rewrite (its model type is not in that table), so MLP names adapt the shared expert's Linears only
    (`SHARED_EXPERT_GROUPS`), with or without attention adapters (layer 0 then: `SHARED_EXPERT_NEEDS`)."""
    if plan.lora_targets == ALL_LINEAR:
        return None if spec.family.shared_expert else _param_wrapper_refusal(spec, plan)
    allowed = _ATTENTION_LINEARS + (sum((g[0] for g in SHARED_EXPERT_GROUPS), ()) if spec.family.shared_expert
                                    else ())
    short = {t.rsplit(".", 1)[-1] for t in plan.lora_targets.split(",")}
    if spec.family.shared_expert and plan.grad_ckpt is not GradCkpt.NONE and plan.precision is Precision.FP32 \
            and not plan.lora_dropout and "shared_expert_gate" in short and not short & {"gate_proj", "up_proj"}:
        return InputError("lora-targets", "an adapted shared_expert_gate without gate_proj or up_proj, checkpointed, "
                          "in fp32 with --lora-dropout 0 is not modelled yet (+1.0 % on a tiny qwen2_moe, at the "
                          "routing-weight mul's backward; with dropout, bf16 or bf16-mixed within 0.003 %); add "
                          "gate_proj,up_proj, or a --lora-dropout above 0", GAP)
    other = sorted(short - set(allowed))
    if other:
        return InputError("lora-targets", f"lora on {spec.model_type!r} is modelled with adapters on the attention "
                          f"Linears{', the shared expert' if spec.family.shared_expert else ''} or all-linear; "
                          f"{', '.join(other)} adapts (or may adapt) the routed part of the mixture-of-experts block, "
                          "which is not modelled yet; use all-linear or e.g. q_proj,k_proj,v_proj,o_proj", GAP)
    return None


def _param_wrapper_refusal(spec: ModelSpec, plan: TrainingPlan) -> InputError | None:
    """mixtral `all-linear` (`lora_experts`): PEFT's ParamWrapper refuses dropout. 4-bit QLoRA quantizes the
    attention Linears only (the router and experts are not Linears) and is modelled as LoRA is."""
    if plan.lora_dropout:
        return InputError("lora-dropout", f"all-linear on {spec.model_type!r} adapts the router and the fused experts "
                          "through PEFT's ParamWrapper, which refuses lora_dropout > 0; use --lora-dropout 0, or "
                          "name the attention Linears (e.g. q_proj,k_proj,v_proj,o_proj)")
    return None


def frozen_moe_backward_moments(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """`gradients.moe_layer_backward_moments` (transformers 5.23 `integrations/moe.py:
    grouped_mm_experts_forward`) with frozen expert, router and shared-expert weights, as bytes beyond the layer's
    LoRA saved tensors plus the layer output's gradient. Each grouped mm's backward makes its input gradient only
    (no grad_weight: E × h × i, E × 2i × h; none for the router or the shared expert's Linears), and the gathered
    tokens (r × h) are not saved (only gate_up's weight gradient read them). qwen2_moe's frozen shared expert (a
    dense MLP whose down_proj saved no input): at its `silu(gate) * up` backward the incoming gradient, d up and
    d silu(gate) (3 × T × si × cb), after the routed part's saved tensors are freed. Symbols as there. qwen2_moe
    checkpointed: the recompute's peaks `_shared_recompute_locals`, `_shared_gate_recompute_step`; an adapted
    shared_expert_gate: `_shared_gate_adapter_bytes`."""
    T = plan.batch_size * plan.seq_len
    h, k = spec.hidden_size, spec.experts_per_token
    i = spec.moe_intermediate_size or spec.intermediate_size
    r = T * k
    cb, rb = act._bytes(plan)
    eb = plan.precision.param_bytes
    wb = act.moe_routing_weight_bytes(spec, plan)
    ob = max(eb, wb)
    inverse_permutation, down_output, gathered_weights = r * 8, r * h * eb, r * wb
    silu_gate, gate_up_output = r * i * eb, r * 2 * i * eb  # (`silu(gate) * up`, the down mm input, is not saved)
    routed_output_grad, routing_weights_grad = r * h * ob, r * wb
    shared = spec.family.shared_expert and spec.shared_expert_intermediate_size
    shared_gate = 0
    if shared:  # the shared-expert gate branch: its output's gradient and the block input's, its mul's saves freed
        shared_gate = T * h * rb - T * cb
    moments = {}
    if plan.grad_ckpt is GradCkpt.FULL:
        residual_local = T * h * rb if rb == 2 else 0
        forward_locals = residual_local + T * spec.num_experts * cb + r * wb + r * 8 + r * 4 + spec.num_experts * 4
        trigger = routed_output_grad if not shared else -T * cb
        moments["recompute end (routing-weight mul)"] = (forward_locals - inverse_permutation + trigger + r * h * ob
                                                         + (_shared_recompute_locals(spec, plan) if shared
                                                            else _routed_recompute_locals(spec, plan)))
        if not shared:  # the down grouped mm's output made, `silu(gate) * up` (its input, saved by none) alive
            moments["recompute, down grouped mm"] = (moments["recompute end (routing-weight mul)"] - r * h * ob
                                                     + r * i * eb)
            moments["recompute end (routing-weight mul)"] += _unpermute_stop_bytes(spec, plan)
    converted = 0 if plan.grad_ckpt is GradCkpt.FULL else (r * h * eb if eb != ob else r * ob)
    moments["routing-weight mul backward"] = (shared_gate + routed_output_grad - inverse_permutation
                                              + 2 * r * h * ob + converted)
    freed = inverse_permutation + down_output + gathered_weights
    moments["down grouped mm backward"] = shared_gate + routing_weights_grad - freed + r * h * eb + r * i * eb
    moments["silu(gate) * up backward"] = shared_gate + routing_weights_grad - freed + 3 * r * i * eb
    freed += silu_gate + gate_up_output
    moments["gate_up grouped mm backward"] = shared_gate + routing_weights_grad - freed + r * 2 * i * eb + r * h * eb
    if shared:
        dropped = frozen_moe_dropped(spec)
        routed_saved = sum(s.bytes for s in act.moe_saved(spec, plan, T) if s.name not in dropped)
        si = spec.shared_expert_intermediate_size
        moments["shared expert backward"] = shared_gate - routed_saved + 3 * T * si * cb
    residual_grad = T * h * plan.precision.param_bytes
    gate_branch = _shared_gate_adapter_bytes(spec, plan) if shared else (0, 0)
    moments = {name: extra - gate_branch[name.startswith("recompute")] for name, extra in moments.items()}
    if shared and plan.grad_ckpt is GradCkpt.FULL and gate_branch[1]:
        moments["recompute, shared_expert_gate adapter"] = (moments["recompute end (routing-weight mul)"]
                                                            + _shared_gate_recompute_step(spec, plan, gate_branch[1]))
    return {name: extra + residual_grad for name, extra in moments.items()}


def _shared_gate_recompute_step(spec: ModelSpec, plan: TrainingPlan, own: int) -> int:
    """From the recompute's routed peak (`_shared_recompute_locals`) to an adapted shared_expert_gate's adapter
    (`modeling_qwen2_moe.py:346`; peft `Linear.forward`): the routed part returned (its weighted and un-permuted
    outputs, r × h × ob each, the gathered tokens, `expert_ids_g`, the histc input and counts freed; its sum,
    T × h × ob, alive), the gate's base output (T × cb) and its adapter's saves (`own`) made, and alive beside
    them lora_B's output and its product with the scaling (T each, the adapter dtype) and, in pure half with
    dropout, `x.to(fp32)` (T × h × 4), which only the dropout reads (lora_A saves the dropout output)."""
    T, h, r = plan.batch_size * plan.seq_len, spec.hidden_size, plan.batch_size * plan.seq_len * spec.experts_per_token
    cb, rb = act._bytes(plan)
    eb = plan.precision.param_bytes
    ob = max(eb, act.moe_routing_weight_bytes(spec, plan))
    ab = 2 if plan.precision.is_mixed else 4
    transient = T * h * 4 if rb == 2 and not plan.precision.is_mixed and plan.lora_dropout else 0
    freed = 2 * r * h * ob + r * h * eb + r * 8 + r * 4 + spec.num_experts * 4
    return -freed + T * h * ob + T * cb + own + 2 * T * ab + transient


def _shared_recompute_locals(spec: ModelSpec, plan: TrainingPlan) -> int:
    """qwen2_moe: the recompute, triggered by the shared-expert gate's mul (the block's last op), peaks in the
    routed part at `weighted_out[inv_perm]` (transformers `integrations/moe.py:524-528`), where also alive are that
    output (r × h × ob), the gathered tokens (r × h × eb, a local: frozen experts' mm saves no input), the inverse
    permutation (made: the moment's `- inverse_permutation` undone), the block input (T × h × rb, a local unless
    lora_A keeps it: fp32, dropout 0, an adapted shared gate/up), the recompute's copy of the CPU RNG state, and
    under autocast the half gradient the block's sum made for the shared branch (T × h × 2). Symbols as
    `frozen_moe_backward_moments`."""
    from llmem.components.lora import layer0_targeted
    from llmem.plan import Device

    T, h, r = plan.batch_size * plan.seq_len, spec.hidden_size, plan.batch_size * plan.seq_len * spec.experts_per_token
    cb, rb = act._bytes(plan)
    eb = plan.precision.param_bytes
    ob = max(eb, act.moe_routing_weight_bytes(spec, plan))
    adapted = {p.name.rsplit(".", 2)[-2] for p in layer0_targeted(spec, plan)}
    kept = plan.precision.param_bytes == 4 and not plan.precision.is_mixed and not plan.lora_dropout \
        and adapted & set(SHARED_EXPERT_GROUPS[0][0])
    rng = act.CPU_RNG_STATE_BYTES if plan.device is Device.CPU else 0
    return (r * h * ob + r * h * eb + r * 8 + (0 if kept else T * h * rb) + rng
            + (T * h * 2 if plan.precision.is_mixed else 0))


def _routed_recompute_locals(spec: ModelSpec, plan: TrainingPlan) -> int:
    """mixtral (no shared expert): the recompute, triggered by the routed output's index backward, stops at the
    un-permuting index's save of `inv_perm` (`_unpermute_stop_bytes`); the forward's locals are still alive then:
    the gathered tokens (r × h × eb: frozen experts' mm saves no input), the block input (T × h × rb: the frozen
    router and experts save none of it) and the recompute's copy of the CPU RNG state (measured: s12-1115, mixtral
    LoRA q/v fp32 checkpointed, -1.50 % without them). Symbols as `frozen_moe_backward_moments`."""
    from llmem.plan import Device

    T, h = plan.batch_size * plan.seq_len, spec.hidden_size
    _, rb = act._bytes(plan)
    rng = act.CPU_RNG_STATE_BYTES if plan.device is Device.CPU else 0
    return T * spec.experts_per_token * h * plan.precision.param_bytes + T * h * rb + rng


def _unpermute_stop_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """mixtral: the recompute stops at the un-permuting index's save of `inv_perm` (IndexBackward0 saves its
    indices; an input is packed before the kernel runs), not at the routing-weight mul: past the mul it has run
    `inv_perm = torch.empty_like(perm)` and `inv_perm[perm] = torch.arange(r)` (transformers 5.23
    `integrations/moe.py:527-529`), so inside that index_put both the inverse permutation and the arange (r int64
    each) are alive: r × 16 B. (qwen2_moe's recompute runs past it: `_shared_recompute_locals`.)"""
    return plan.batch_size * plan.seq_len * spec.experts_per_token * 16


def _shared_gate_adapter_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int]:
    """An adapted `shared_expert_gate` (all-linear): what its adapter saves beyond the other Linears reading the
    block input (its own input copy or cast, lora_A output, scaling, autocast weight casts), less its weight
    gradients (r × (h + 1) × 4), which its branch's backward, the block's first, makes: (later moments, where that
    branch's backward has freed the saves, the recompute's peak, where they are not made yet)."""
    from llmem.components.lora import layer0_targeted
    from llmem.components.lora_activations import _adapter_input_saved

    if not any(p.name.endswith("shared_expert_gate.weight") for p in layer0_targeted(spec, plan)):
        return 0, 0
    T, h, rank = plan.batch_size * plan.seq_len, spec.hidden_size, plan.lora_rank
    n = sum(p.name.rsplit(".", 2)[-2] in SHARED_EXPERT_GROUPS[0][0] for p in layer0_targeted(spec, plan))
    inputs = [sum(x.bytes for x in _adapter_input_saved("g", plan, T, h, k, shared=True)) for k in (n, n - 1)]
    mixed = plan.precision.is_mixed
    own = inputs[0] - inputs[1] + T * rank * (2 if mixed else 4) + 8 + (rank * (h + 1) * 2 if mixed else 0)
    return own - rank * (h + 1) * 4, own


def frozen_moe_backward_peak_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The largest of `frozen_moe_backward_moments`."""
    return max(frozen_moe_backward_moments(spec, plan).values())
