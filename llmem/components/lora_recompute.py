"""A checkpointed LoRA layer's recompute (`--method lora|qlora --grad-ckpt full`): what it holds beyond its saved
tensors at the highest moments of the recompute of its forward (`recompute_moments`); the saved tensors themselves
are `llmem.components.lora_activations.layer_saved`."""

from __future__ import annotations

from llmem.components import quant_autocast
from llmem.components.lora import _module, is_lora, layer0_targeted
from llmem.components.lora_activations import layer_saved
from llmem.components.saved import FP32, Saved, _bytes
from llmem.plan import Device, GradCkpt, Method, Precision, TrainingPlan
from llmem.spec import ModelSpec


def recompute_moments(spec: ModelSpec, plan: TrainingPlan) -> dict[str, tuple[list, list]]:
    """`--grad-ckpt full`: what a checkpointed LoRA layer holds beyond its saved tensors (`layer_saved`) at the
    highest moments of the recompute of its forward, as {moment: (forward tensors, activation gradients)}.

    `torch.utils.checkpoint` (`use_reentrant=False`) recomputes the layer inside the backward of its first node that
    unpacks a saved tensor (down_proj's `lora_B` mm; target sets without down_proj are not modelled here) and stops
    with `_StopRecomputationError` in the pack hook of the last saved tensor — lora_B's saves in down_proj, before
    that mm runs ("recompute stopped"). Then the recomputed forward's locals are still alive:
      - pure half: the residual stream after attention (`residual`, saved by no op: the norm saves its fp32 copy);
      - the post_attention_layernorm output (the MLP's input `x`, tokens × h in the residual dtype), unless lora_A
        of gate/up keeps it (fp32 with dropout 0);
      - `act_fn(gate_proj(x)) * up_proj(x)` (down_proj's input, tokens × i × cb), unless lora_A keeps it (fp32,
        dropout 0);
      - down_proj's base_layer output (tokens × h × cb) and `x.to(lora_A.weight.dtype)`, the fp32
        copy of its input (tokens × i × 4), when not saved — under autocast (lora_A saves its own half cast) and in
        pure half with dropout > 0 (lora_A saves the dropout output); the recompute has not yet created down_proj's
        `scaling` tensor, which `layer_saved` counts (8 bytes);
      - `torch.random.fork_rng`'s copy of the CPU RNG state (cpu profile), taken by the recompute (restored on exit).
    Activation gradients beside the layer output's (which the walk counts): down_proj's
    `result + lora_B(...) * scaling` backward made `grad * scaling` (tokens × h, fp32; half under autocast); in pure
    half `result` (half) + the fp32 product is fp32, so AddBackward0 also cast the gradient to the half base output
    (tokens × h × cb). Under autocast the fp32 residual add casts the gradient for the (half) MLP output
    (tokens × h × 2).
    Two earlier moments of the recompute can be higher. "recompute, up_proj adapter sum": up_proj's
    `result + lora_B(...) * scaling` (intermediate-sized), when down_proj's saved tensors are not recomputed yet and
    up_proj's output (the sum's `.to(result dtype)`) is not made: alive are its base_layer output, the product, the
    sum (fp32 unless autocast) and, with dropout > 0, up_proj's `x.to(fp32)` (in pure half the CPU's add also
    makes an fp32 copy of the half base output inside the kernel — TensorIterator's type promotion, kernel scratch
    that CUDA's dynamic casting does not allocate).
    QLoRA (peft's bnb `Linear4bit.forward`): `result = base_layer(x).clone()`, and outside autocast the adapter
    product is cast to result's dtype before `result + output`: in pure half no fp32 sum and no type-promotion copy
    (up_proj's moment is the product beside lora_B's fp32 output), and the backward's gradient for the base branch
    is the layer's own (no cast).
    Under autocast with dropout > 0 the moment just before the stop is higher ("recompute, down_proj lora_A"):
    while down_proj's lora_A mm runs, its argument — the fp32 dropout output, which nothing saves (lora_A saves its
    half cast) — is alive, and lora_B's half weight cast is not made yet. On the cpu profile the bf16 gemm (oneDNN)
    also allocates a scratch buffer inside that mm (16 KiB for a 128 × 176 @ 176 × 16 product on this machine; its
    size follows the CPU kernel's blocking, not the tensors' shapes alone), which is not modelled: bf16-mixed rows whose
    peak is this moment (or lora_A's mm with dropout 0, a little below the stop) measure up to that much above the
    estimate (0.4-0.7 % on the CPU suite's tiny models). Half adapters (`spec.half_adapters`): `_half`."""
    if not is_lora(plan) or plan.grad_ckpt is not GradCkpt.FULL or spec.derived is not None:
        return {}  # a derived architecture's traced layer backward (`llmem.derive`)
    if spec.family.grouped_experts:  # the MoE block's recompute: `lora_moe.frozen_moe_backward_moments`
        return {}
    adapted = {_module(p).rsplit(".", 1)[-1] for p in layer0_targeted(spec, plan)}
    if "down_proj" not in adapted:
        # The recompute then starts in the frozen down_proj's MmBackward0 and stops at its save of the weight, with
        # none of the gradients above: not modelled (such target sets keep the walk's layer-backward moment).
        return {}
    common, grads = _common(spec, plan, adapted), _gradients(spec, plan)
    stop = _stop(spec, plan, common)
    moments = {"recompute stopped": (stop, grads)}
    tokens, h, i = plan.batch_size * plan.seq_len, spec.hidden_size, spec.intermediate_size
    if plan.precision.is_mixed and plan.lora_dropout:
        moments["recompute, down_proj lora_A"] = (stop + [
            Saved("down_proj lora_dropout output (fp32, lora_A's argument)", tokens * i * FP32),
            Saved("down_proj lora_B autocast weight cast, not yet made", -plan.lora_rank * h * 2)], grads)
    if "up_proj" in adapted:
        moments["recompute, up_proj adapter sum"] = (_up_proj_sum(spec, plan, common), grads)
    return moments


def _half(spec: ModelSpec) -> bool:
    """Half adapters (DeepSpeed's bf16 engine casts them with the module): they compute in the half dtype — no
    `x.to(fp32)`, lora_A keeps x itself with dropout 0, the product, the sums and `grad * scaling` are half and
    AddBackward0 casts nothing."""
    return getattr(spec, "half_adapters", False)


def _kept_by_lora_a(plan: TrainingPlan, half: bool = False) -> bool:
    """lora_A saves its input x itself (fp32 or half adapters, dropout 0)."""
    return (plan.precision is Precision.FP32 or half) and not plan.lora_dropout


def _common(spec: ModelSpec, plan: TrainingPlan, adapted: set[str]) -> list[Saved]:
    """Alive at every moment of the recompute (recomputed tensors the layer or the MLP holds)."""
    tokens, h = plan.batch_size * plan.seq_len, spec.hidden_size
    _, rb = _bytes(plan)
    common = []
    if rb == 2:
        common.append(Saved("residual stream after attention (held by the decoder layer)", tokens * h * rb))
    if not (_kept_by_lora_a(plan, _half(spec)) and adapted & {"gate_proj", "up_proj"}):
        common.append(Saved("post_attention_layernorm output (the MLP input, held by the MLP)", tokens * h * rb))
    if plan.device is Device.CPU:
        from llmem.components.activations import CPU_RNG_STATE_BYTES

        common.append(Saved("recompute's fork_rng copy of the CPU RNG state", CPU_RNG_STATE_BYTES))
    return common


def _gradients(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """The activation gradients made before the recompute, beside the layer output's (which the walk counts)."""
    tokens, h = plan.batch_size * plan.seq_len, spec.hidden_size
    cb, rb = _bytes(plan)
    if _half(spec):  # a half product added to the half base output: no cast
        return [Saved("down_proj grad * scaling (lora_B output gradient, half)", tokens * h * cb)]
    mixed = plan.precision.is_mixed
    grads = [Saved("down_proj grad * scaling (lora_B output gradient)", tokens * h * (2 if mixed else FP32))]
    if rb == 2 and plan.method is not Method.QLORA:
        grads.append(Saved("down_proj base_layer output gradient (cast from fp32 by AddBackward0)", tokens * h * cb))
    if mixed and not quant_autocast.applies(plan):  # (QLoRA: down_proj's output is already fp32)
        grads.append(Saved("MLP output gradient (cast to half by the fp32 residual add)", tokens * h * 2))
    return grads


def _stop(spec: ModelSpec, plan: TrainingPlan, common: list[Saved]) -> list[Saved]:
    """Where the recompute stops: in down_proj, before lora_B's mm."""
    tokens, h, i = plan.batch_size * plan.seq_len, spec.hidden_size, spec.intermediate_size
    _, rb = _bytes(plan)
    mb = quant_autocast.mlp_bytes(plan)  # the compute dtype's, fp32 for QLoRA under autocast
    half = _half(spec)
    stop = list(common)
    if not _kept_by_lora_a(plan, half):
        stop.append(Saved("act_fn(gate) * up (down_proj input)", tokens * i * mb))
    stop.append(Saved("down_proj base_layer output", tokens * h * mb))
    # (QLoRA under autocast: peft's bnb layer does not cast x, already fp32)
    if not half and not quant_autocast.applies(plan) and (plan.precision.is_mixed or (rb == 2 and plan.lora_dropout)):
        stop.append(Saved("down_proj x.to(fp32) (input cast to lora_A's dtype)", tokens * i * FP32))
    stop.append(Saved("down_proj scaling, not yet created", -8))
    return stop


def _up_proj_sum(spec: ModelSpec, plan: TrainingPlan, common: list[Saved]) -> list[Saved]:
    """up_proj's `result + lora_B(...) * scaling`, before down_proj's saved tensors are recomputed."""
    tokens, h, i = plan.batch_size * plan.seq_len, spec.hidden_size, spec.intermediate_size
    _, rb = _bytes(plan)
    cb = quant_autocast.mlp_bytes(plan)  # the compute dtype's, fp32 for QLoRA under autocast
    half = _half(spec)
    mixed, pure_half = plan.precision.is_mixed or half, rb == 2 and not half  # (half adapters: as autocast's)
    ab = 2 if mixed else FP32  # the adapter product's dtype
    later = sum(x.bytes for x in layer_saved(spec, plan) if x.name.startswith("down_proj"))
    up = common + [Saved("down_proj saved tensors, not yet recomputed", -later),
                   Saved("up_proj output, not yet made", -tokens * i * cb),
                   Saved("up_proj base_layer output", tokens * i * cb),
                   Saved("up_proj lora_B(...) * scaling", tokens * i * ab)]
    if plan.method is Method.QLORA and pure_half:  # the product is made while lora_B's fp32 output is alive
        up.append(Saved("up_proj lora_B output (fp32)", tokens * i * FP32))
    else:
        up.append(Saved("up_proj result + lora (the sum)", tokens * i * (cb if mixed else FP32)))
    if pure_half and plan.lora_dropout:
        up.append(Saved("up_proj x.to(fp32) (input cast to lora_A's dtype)", tokens * h * FP32))
    return up
