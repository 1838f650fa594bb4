"""What LoRA layers keep for backward (`--method lora|qlora`): the frozen base's saved tensors, the adapters' own,
layer 0 with an input that needs no gradient, the layer backward's gradients and the checkpointed layer's recompute.
The program and the adapters' parameters are described in `llmem.components.lora`, which re-exports these terms."""

from __future__ import annotations

from llmem.components.lora import (
    _module,
    in_out,
    is_lora,
    layer0_targeted,
    targeted,
    trains_copy,
)
from llmem.components.saved import FP32
from llmem.errors import GAP, InputError
from llmem.plan import Method, Precision, TrainingPlan
from llmem.spec import ModelSpec, per_spec


@per_spec()
def mlp_backward_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The MLP's intermediate-sized gradients at the peak of a layer's backward under LoRA, beyond its saved tensors.
    Two moments: down_proj's backward (the adapter branch runs first, then the base's input gradient joins it: two
    intermediate-sized gradients, less what the branch freed: `lora_forward.down_proj_backward_freed_bytes`), and the
    backward of `silu(gate) * up` (the incoming gradient, d up and d silu(gate): three, with what down_proj's adapter
    saved already freed; with a frozen down_proj nothing saved the down_proj input at all)."""
    from llmem.components import quant_autocast as qa  # (fp32 MLP tensors, down's adapter done: QLoRA mixed)
    tokens, inter = plan.batch_size * plan.seq_len, spec.intermediate_size // plan.tp
    grad = tokens * inter * qa.mlp_bytes(plan)
    down = [p for p in layer0_targeted(spec, plan) if _module(p).rsplit(".", 1)[-1] == "down_proj"]
    items = _adapter_input_saved("down_proj", plan, tokens, inter, len(down), shared=True) if down else []
    from llmem.components.lora_forward import down_proj_backward_freed_bytes as freed
    done = sum(s.bytes for s in items) + qa.down_adapter_done_bytes(spec, plan)
    return max(2 * grad - freed(plan, items), 3 * grad - done)


# --- activations -------------------------------------------------------------------------------------------------
# Llama-like decoder layers (the `llama_family_saved` table without phi3's fused projections and the MoE MLPs): which
# Linears read the same input, that input's width, and the full-fine-tuning entries that exist only because those
# Linears save their input for a weight gradient.
_INPUT_GROUPS = (  # (Linear names, width key, full-FT entries saved for their weight gradient)
    (("q_proj", "k_proj", "v_proj"), "h", ("input_layernorm.output", "autocast input casts q/k/v")),
    (("o_proj",), "q", ()),  # its input is the sdpa output, which sdpa saves anyway
    (("gate_proj", "up_proj"), "h", ("post_attention_layernorm.output", "autocast input casts gate/up")),
    (("down_proj",), "i", ("silu(gate) * up",)),
)
# Which entries of the full-fine-tuning table a tensor's `requires_grad` decides (`_requires_grad` below). Layer 0's
# input does not require grad (the embeddings are frozen): an op records a graph node, and saves anything, only when
# one of its inputs requires grad, and a frozen Linear's output requires grad only when its input does. So in layer 0
# everything before the first adapted Linear saves nothing; after it the layer saves as any other.
_NEEDS = {  # table entry -> the tensor whose requires_grad decides whether it is saved
    "input (residual stream)": "input", "input_layernorm.rsqrt": "input", "input_layernorm.to_fp32": "input",
    "input_layernorm.(1+weight) fp32": "input",
    # qwen3's per-head norms on a projection output (activations.llama_family_saved)
    "q_norm.rsqrt": "q_proj", "q_norm.input in fp32": "q_proj",
    "k_norm.rsqrt": "k_proj", "k_norm.input in fp32": "k_proj",
    "residual after attention": "residual", "post_attention_layernorm.rsqrt": "residual",
    "post_attention_layernorm.to_fp32": "residual", "post_attention_layernorm.(1+weight) fp32": "residual",
    # SiluBackward0 saves its input; mul(silu(gate), up) saves each operand when the other requires grad
    "gate_proj": "gate_proj", "up_proj": "gate_proj", "silu(gate)": "up_proj",
}
# Eager attention (transformers 5.23 `models/llama/modeling_llama.py:180-202`, mixtral's and qwen2_moe's copies):
# `matmul(q, kᵀ)` and `matmul(probs, v)` run as bmm, whose node saves each operand only for the other's gradient
# (torch 2.13 `tools/autograd/derivatives.yaml` bmm: self's gradient reads mat2, mat2's reads self; the generated
# node saves a tensor only when a gradient that reads it is required). So in layer 0 q is kept only when k requires
# grad, k when q does, v when the probabilities do ("scores": q or k), and the probabilities' bmm operand (their
# cast, or the softmax output itself in fp32) only when v does; softmax saves its output when the scores require
# grad, dropout its mask likewise. Elsewhere (the layer input requires grad) every entry is kept, as before.
_EAGER_NEEDS = {
    "eager q (bmm operand)": "k_proj", "eager k (bmm operand)": "q_proj",
    "eager k (bmm operand, a stride-0 view of one kv head)": "q_proj",
    "eager v (bmm operand)": "scores", "eager v (bmm operand, a stride-0 view of one kv head)": "scores",
    "probabilities cast to the compute dtype (bmm operand)": "v_proj",
    "dropped probabilities (bmm operand)": "v_proj",
}
# the o_proj input: under full fine-tuning saved for o_proj's weight gradient; under LoRA only by its adapter
_O_PROJ_INPUT = "attention output contiguous (o_proj input)"
_ATTENTION_LAST = "residual after attention"
# what LoRA's table leaves out of full fine-tuning's (and every `.normalized`): saved only for weight gradients
_DROPPED = frozenset({n for _, _, names in _INPUT_GROUPS for n in names} | {_O_PROJ_INPUT})


ATTENTION_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _eager_needs(table) -> dict[str, str]:
    """`_EAGER_NEEDS`, with the softmax output's: kept by softmax when the scores require grad, and, as the
    probabilities' bmm operand itself (fp32, no dropout: no cast or dropout output after it), when v does."""
    names = {s.name for s in table}
    operand = names & {"probabilities cast to the compute dtype (bmm operand)", "dropped probabilities (bmm operand)"}
    return {**_EAGER_NEEDS, "softmax output (fp32)": "scores"} if operand else _EAGER_NEEDS


def _requires_grad(adapted: set[str], first: bool) -> dict[str, bool]:
    """Whether each tensor of a llama-like layer requires grad: the layer input (not in layer 0), each projection's
    output (its input does, or it has an adapter), the attention (sdpa records a node when q, k or v does), the
    residual after attention (the o_proj output does), and the down_proj input silu(gate) * up."""
    g = {"input": not first}
    for proj in ATTENTION_INPUT_PROJECTIONS:
        g[proj] = g["input"] or proj in adapted
    g["attention"] = g["q_proj"] or g["k_proj"] or g["v_proj"]
    g["scores"] = g["q_proj"] or g["k_proj"]  # q·kᵀ, the softmax and the probabilities (eager)
    g["o_proj"] = g["attention"] or "o_proj" in adapted
    g["residual"] = g["input"] or g["o_proj"]
    for proj in ("gate_proj", "up_proj"):
        g[proj] = g["residual"] or proj in adapted
    g["down_proj input"] = g["gate_proj"] or g["up_proj"]
    return g


def check_supported(spec: ModelSpec, plan: TrainingPlan) -> None:
    """LoRA's tables are hand-written for the families with the `lora_activations` trait and traced for the others
    (`traced_spec`; `llmem.derive.lora`, which names what it does not model)."""
    spec = traced_spec(spec, plan)
    if is_lora(plan) and spec.derived is not None:
        from llmem.derive.lora import refusal

        error = refusal(spec, plan)
        if error is not None:
            raise error
    elif is_lora(plan) and not spec.family.lora_activations:
        from llmem.families import with_trait

        raise InputError("method", f"LoRA activations are modelled for {', '.join(with_trait('lora_activations'))} "
                         f"so far; {spec.model_type!r} is not one of them (use --method full)", GAP)
    from llmem.components.lora_moe import moe_targets_refusal

    error = moe_targets_refusal(spec, plan) if is_lora(plan) and spec.derived is None else None
    if error is not None:
        raise error
    if is_lora(plan) and spec.num_layers > 1 and not spec.memo(("lora.uniform", plan.lora_targets),
                                                                lambda: _uniform_targets(spec, plan)):
        raise InputError("lora-targets", f"{plan.lora_targets} adapts different Linears in different decoder "
                         "layers, which is not modelled; name modules by their name within a layer (e.g. "
                         "q_proj or self_attn.o_proj), or use all-linear")


def traced_spec(spec: ModelSpec, plan: TrainingPlan) -> ModelSpec:
    """A LoRA plan on a hand-written family without the `lora_activations` trait (gpt2, opt, bloom, falcon,
    gpt_neox, phi3, gemma2, ...): the same spec with its activation tables traced from the PEFT model
    (`llmem.derive`), as for a derived architecture; its parameters stay the hand-written inventory. Other plans
    keep `spec`."""
    config = getattr(spec, "source_config", None)
    if not is_lora(plan) or spec.derived is not None or spec.family.lora_activations or not config:
        return spec
    return spec.memo(("lora.traced_spec",), lambda: _traced(spec, config))


def _traced(spec: ModelSpec, config: dict) -> ModelSpec:
    import dataclasses

    from llmem.derive.lora import traced_derived

    caveat = f"LoRA on {spec.model_type!r}: its activations are traced from transformers on fake tensors"
    cap = spec.options.get("final_logit_softcapping")  # the family's default (gemma2): the traced logits' tanh
    config = {**config, "final_logit_softcapping": cap} if cap and "final_logit_softcapping" not in config else config
    return dataclasses.replace(spec, derived=traced_derived(spec, config), caveats=(*spec.caveats, caveat))


def _uniform_targets(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether every decoder layer adapts the same Linears (the activation tables are per layer, all alike)."""
    by_layer: dict[int, set[str]] = {n: set() for n in range(spec.num_layers)}
    for p in targeted(spec, plan):
        if p.layer is not None:
            by_layer[p.layer].add(_module(p).split(f".{p.layer}.", 1)[-1])
    return all(names == by_layer[0] for names in by_layer.values())


def _adapter_input_saved(name: str, plan: TrainingPlan, tokens: int, width: int, n: int, shared: bool,
                         input_grad: bool = True, half: bool = False) -> list:
    """What lora_A (and the dropout before it) keep of the input of `n` adapted Linears that read the same tensor.
    `shared`: that tensor is saved anyway by full fine-tuning only for weight gradients (so with dropout 0 in fp32,
    lora_A's save of it costs one copy for the group); False for o_proj, whose input sdpa keeps in any case.
    `input_grad`: whether that input requires grad (not in layer 0's q/k/v: dropout then keeps no noise or mask).
    `half`: the adapters are half (FSDP2 mixed, `plan` the pure-half compute plan): x is not cast, so this is the
    fp32 program with 2-byte elements."""
    from llmem.components.activations import Saved, dropout_saved

    mixed = plan.precision.is_mixed
    pure_half = plan.precision in (Precision.BF16, Precision.FP16) and not half
    elem = plan.precision.compute_bytes if half else FP32  # the adapters' input dtype
    p = plan.lora_dropout
    items = []
    if not p:
        if mixed:
            items.append(Saved(f"{name}: lora_A autocast input casts", n * tokens * width * 2))
        elif pure_half:
            items.append(Saved(f"{name}: x.to(fp32) (lora_A input)", n * tokens * width * FP32))
        elif shared:
            items.append(Saved(f"{name}: input kept by lora_A", tokens * width * elem))
        return items
    for _ in range(n if input_grad else 0):  # each adapted Linear runs its own nn.Dropout on its input
        items += dropout_saved(f"{name} lora_dropout", plan, tokens * width, elem, p)
    if mixed:
        items.append(Saved(f"{name}: lora_A autocast casts of the dropout outputs", n * tokens * width * 2))
    else:
        items.append(Saved(f"{name}: lora_dropout outputs (lora_A input)", n * tokens * width * elem))
    return items


def layer_saved(spec: ModelSpec, plan: TrainingPlan, first: bool = False, half: bool = False) -> tuple:
    """One decoder layer's saved tensors under LoRA (per spec, plan and flags: `_layer_saved`; `spec.half_adapters`)."""
    return spec.memo(("lora.layer_saved", plan.key, first, (half := half or spec.half_adapters)),
                     lambda: tuple(_layer_saved(spec, plan, first, half)), per_plan=True)


def _layer_saved(spec: ModelSpec, plan: TrainingPlan, first: bool, half: bool) -> list:
    """One decoder layer's saved tensors under LoRA (`first`: layer 0, whose input does not require grad; `half`:
    half adapters, see `half_adapters`, with `plan` the pure-half compute plan).

    Full fine-tuning's table without what only weight gradients needed, each entry kept only when the tensor that
    decides it requires grad (`_NEEDS`, `_requires_grad`): in layer 0 the attention (q/k/v, sdpa output and
    statistics) is saved only when q_proj, k_proj or v_proj has an adapter; the second norm only from an adapted
    o_proj on; the MLP's gate/up products per adapted gate_proj / up_proj. Then what each group of adapted Linears
    keeps (`_adapter_input_saved`, lora_A's output, the scaling, autocast weight casts)."""
    from llmem.components import activations as act
    from llmem.components import lora_experts
    from llmem.components.activations import Saved
    from llmem.components.lora_moe import frozen_moe_dropped, moe_needs, shared_expert_grad

    if spec.derived is not None:  # traced with the PEFT model (`llmem.derive.lora`): layer 0 is a kind of its own
        return list((spec.derived.at(0) if first else spec.derived).layer_saved(plan))
    tokens = plan.batch_size * plan.seq_len
    adapted, groups = _adapted_groups(spec, plan)
    grad, needs = shared_expert_grad(spec, _requires_grad(adapted, first), adapted), _NEEDS | moe_needs(spec)
    needs = needs | _eager_needs(act.layer_saved(spec, plan))
    items, in_attention, in_mlp = [], False, False
    experts = lora_experts.adapts_experts(spec, plan)  # mixtral all-linear: the stacks' inputs are kept
    dropped = (_DROPPED | frozen_moe_dropped(spec)) - (lora_experts.KEPT if experts else frozenset())
    for s in act.layer_saved(spec, plan):
        if s.name in ("q_embed (RoPE)", "eager q (bmm operand)", "math sdpa q*scale (fp32)"):
            in_attention = True  # attention_saved's entries, up to the residual after attention
        if s.name == _ATTENTION_LAST or s.name.startswith("post_attention_layernorm"):
            in_attention, in_mlp = False, True  # the MLP's entries (a MoE block's) need the residual's grad
        if s.name in dropped or s.name.endswith(".normalized"):
            continue
        after = "attention" if in_attention else "residual" if in_mlp else "input"
        if not grad[needs.get(s.name, after)]:
            continue
        items.append(s)
    # the o_proj input is the sdpa output itself (fused sdpa, which saves it when it records a node); after eager or
    # the CPU math path it is a new contiguous tensor only o_proj's adapter keeps
    o_input_saved = grad["attention"] and _flash_output_is_o_input(spec, plan)
    group_input_grad = _group_input_grad(spec, plan, first)
    widths = {"h": spec.hidden_size, "q": spec.num_heads * spec.head_dim, "i": spec.intermediate_size,
              "si": spec.shared_expert_intermediate_size}
    a_bytes = 2 if plan.precision.is_mixed or half else FP32
    for k, (names, width, full_ft) in enumerate(_input_groups(spec)):
        count, ins, outs = groups[k]
        if not count:
            continue
        label = "/".join(names)
        shared = bool(full_ft) or (names == ("o_proj",) and not o_input_saved)
        items += _adapter_input_saved(label, plan, tokens, widths[width], count, shared=shared,
                                      input_grad=group_input_grad[k], half=half)
        items.append(Saved(f"{label}: lora_A output (lora_B input)", count * tokens * plan.lora_rank * a_bytes))
        # `lora_B(...) * scaling`: the Python float becomes a 0-dim float64 tensor that MulBackward0 saves
        items.append(Saved(f"{label}: scaling (0-dim float64 saved by mul)", count * 8))
        if plan.precision.is_mixed:  # lora_A's only where its input requires grad (`unsaved_adapter_copy_bytes`)
            items.append(Saved(f"{label}: autocast casts of lora_A/lora_B weights",
                               plan.lora_rank * (outs + ins * group_input_grad[k]) * 2))
    return items + lora_experts.saved(spec, plan, half)


def _group_input_grad(spec: ModelSpec, plan: TrainingPlan, first: bool) -> tuple[bool, ...]:
    """Per group of `_input_groups`, whether its Linears' input requires grad (`_requires_grad`)."""
    adapted, _ = _adapted_groups(spec, plan)
    grad = _requires_grad(adapted, first)
    return grad["input"], grad["attention"], grad["residual"], grad["down_proj input"]



def _input_groups(spec: ModelSpec) -> tuple:
    """`_INPUT_GROUPS`, with a shared-expert MoE block's Linears in place of the dense MLP's (`lora_moe`)."""
    from llmem.components.lora_moe import SHARED_EXPERT_GROUPS

    return _INPUT_GROUPS[:2] + SHARED_EXPERT_GROUPS if spec.family.shared_expert else _INPUT_GROUPS


def _adapted_groups(spec: ModelSpec, plan: TrainingPlan) -> tuple[frozenset, tuple[tuple[int, int, int], ...]]:
    """Layer 0's adapted Linears by short name, and per group of `_INPUT_GROUPS` how many of its Linears are adapted
    and the sums of their in and of their out features (lora_A's weight is rank × in, lora_B's out × rank); once per
    target list."""
    def compute() -> tuple[frozenset, tuple[tuple[int, int, int], ...]]:
        mods = layer0_targeted(spec, plan)
        short = [_module(p).rsplit(".", 1)[-1] for p in mods]
        pairs = list(zip(mods, short, strict=True))
        groups = tuple((sum(n in names for n in short), sum(in_out(spec, p)[0] for p, n in pairs if n in names),
                        sum(in_out(spec, p)[1] for p, n in pairs if n in names))
                       for names, _, _ in _input_groups(spec))
        return frozenset(short), groups
    return spec.memo(("lora.adapted_groups", plan.lora_targets), compute)


def _flash_output_is_o_input(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether the o_proj input is the fused sdpa's own output (saved by sdpa): llama-like tables list no separate
    contiguous o_proj input for the fused kernel."""
    from llmem.components import activations as act

    return not any(s.name == _O_PROJ_INPUT for s in act.layer_saved(spec, plan))


def layer_activation_bytes(spec: ModelSpec, plan: TrainingPlan, first: bool = False, half: bool = False) -> int:
    return spec.memo(("lora.layer_activation_bytes", plan.key, first, half),
                     lambda: sum(s.bytes for s in layer_saved(spec, plan, first, half)), per_plan=True)


@per_spec()
def first_layer_saving_bytes(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> int:
    """How much less layer 0 keeps than the others (its input needs no gradient; with a trainable embedding copy
    it does, and layer 0 keeps what the others keep)."""
    if trains_copy(spec, plan, "embed"):
        return 0
    return layer_activation_bytes(spec, plan, half=half) - layer_activation_bytes(spec, plan, first=True, half=half)


def layer0_input_requires_grad(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether layer 0's input requires grad under LoRA: PEFT's input-require-grads hook under checkpointing
    (`embeddings_require_grad`), or a trainable embedding copy (`--lora-modules-to-save embed_tokens`)."""
    return embeddings_require_grad(plan) or trains_copy(spec, plan, "embed")


def embeddings_require_grad(plan: TrainingPlan) -> bool:
    """Whether layer 0's input requires grad under LoRA. PEFT's `PeftModel.__init__` finds the base model
    `is_gradient_checkpointing` (`--grad-ckpt full` is enabled before `get_peft_model`) and, unless the base is
    loaded in 4/8 bits (QLoRA), calls `model.enable_input_require_grads()`: a forward hook that makes the embedding
    output require grad. Then layer 0 saves as any other layer. Otherwise the frozen embeddings make an output
    that needs no gradient (`layer_saved(..., first=True)`)."""
    from llmem.plan import GradCkpt

    return plan.grad_ckpt is GradCkpt.FULL and plan.method is Method.LORA


def final_norm_saved(spec: ModelSpec, plan: TrainingPlan) -> list:
    """The final norm under LoRA: the frozen norm weight and lm_head save neither `normalized` nor the lm_head
    input; the last layer's output and the rsqrt stay (the input gradient needs them)."""
    from llmem.components import activations as act

    if spec.derived is not None:  # traced with the PEFT model (`llmem.derive.lora`)
        return act.final_norm_saved(spec, plan)
    head = trains_copy(spec, plan, "head")  # a trainable lm_head copy saves its input for its weight gradient
    return [s for s in act.final_norm_saved(spec, plan)
            if not s.name.endswith(".normalized") and (head or not s.name.startswith("lm_head input"))]


@per_spec()
def final_norm_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(s.bytes for s in final_norm_saved(spec, plan))


# autocast's weight copies under LoRA, a checkpointed layer's recompute and the layers kept under `--ckpt-every`
# (their own modules; read through this one)
from llmem.components.lora_casts import (  # noqa: E402, F401
    first_layer_unsaved_copy_bytes,
    layer_adapter_cast_bytes,
    unsaved_adapter_copy_bytes,
)
from llmem.components.lora_checkpointed import (  # noqa: E402, F401
    current_layer_backward_bytes,
    kept_layers_bytes,
    recompute_bytes,
)
