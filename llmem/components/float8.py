"""torchao float8 training (`--float8 tensorwise|rowwise`): the decoder layers' Linears swapped for `Float8Linear`
by `torchao.float8.convert_to_float8_training` (torchao 0.18.0), as torchtitan's float8 converter applies it.

What it changes in memory, from torchao 0.18.0's source (`torchao/float8/`):
- Nothing that stays. `Float8Linear.from_float` keeps the module's own weight (`float8_linear.py:315`); dynamic
  scaling has no amax or scale buffers (delayed scaling was deleted, `float8_linear.py:321-323`).
- Nothing saved. `matmul_with_hp_or_float8_args.forward` saves the high-precision input and weight
  (`ctx.save_for_backward(input_hp, weight_hp_t)`, `float8_linear.py:45`), as `F.linear` does, and casts them to
  fp8 again in backward (`float8_linear.py:107-195`).
- Transients. Each cast (`hp_tensor_to_float8_dynamic`, `float8_scaling_utils.py:56-72`) takes `abs` for the amax
  (freed once reduced, `float8_utils.py:65`), then `_ToFloat8ConstrFunc.forward` makes an fp32 copy times the scale
  (`float8_training_tensor.py:153`) and `to_fp8_saturated` clamps it in fp32 and casts the clamp to fp8
  (`float8_utils.py:136-137`): at the fp8 cast the scaled fp32 tensor, its fp32 clamp and the fp8 result are alive
  together, 9 bytes per element. Backward keeps each cast as a local until it returns.

The largest of these comes in a decoder layer's backward, at the last MLP Linear (down_proj, input tokens x
intermediate): after its input gradient is made, its saved input is cast for the weight gradient
(`float8_linear.py:185`) beside the input gradient, the two fp8 casts of the output gradient (`float8_linear.py:113`,
`:167`) and the fp8 weight (`:131`). `llmem.walk.float8` puts that moment into the walk.

torchtitan's filter (`torchtitan/components/quantization/utils.py` `module_filter_fn`, with `filter_fqns` naming the
output layer): an `nn.Linear` whose weight dims are both divisible by 16, not the lm_head.
"""

from __future__ import annotations

from llmem.choices import Float8
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

FP8_BYTES = 1  # float8_e4m3fn (every cast of both recipes, `Float8LinearConfig.from_recipe_name`)
FP32_BYTES = 4
CAST_BYTES_PER_ELEMENT = FP32_BYTES + FP32_BYTES + FP8_BYTES  # scaled fp32, its clamp, the fp8 result
FILTER_MULTIPLE = 16  # torchtitan's module_filter_fn: both weight dims divisible by 16


def applies(plan: TrainingPlan) -> bool:
    return plan.float8 is not Float8.NONE


def converted(in_features: int, out_features: int) -> bool:
    """torchtitan's `module_filter_fn`: a Linear is converted when both of its weight's dims are multiples of 16."""
    return in_features % FILTER_MULTIPLE == 0 and out_features % FILTER_MULTIPLE == 0


def cast_peak_bytes(numel: int) -> int:
    """The peak of one high-precision -> fp8 cast beyond its input: the fp32 `tensor.to(float32) * scale`
    (`float8_training_tensor.py:153`), its fp32 `clamp` and the fp8 `.to` (`float8_utils.py:136-137`), alive together
    at the last. (The `abs` for the amax, `float8_utils.py:65`, and the fp32 copy before the multiply are freed
    earlier and are smaller.)"""
    return CAST_BYTES_PER_ELEMENT * numel


def scale_bytes(plan: TrainingPlan, rows: int) -> int:
    """One cast's fp32 scale: one value (tensorwise, `float8_utils.py:65`), or one per row along the reduced dim
    (rowwise: `torch.amax(..., dim, keepdim=True)`, `float8_utils.py:69`)."""
    return FP32_BYTES * (rows if plan.float8 is Float8.ROWWISE else 1)


def down_backward_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """Bytes beyond a decoder layer's saved tensors and its output gradient when down_proj's backward casts its saved
    input (tokens x intermediate) for the weight gradient (`float8_linear.py:185`): its input gradient (in the
    compute dtype, `float8_linear.py:143`), as gradients; and as temporaries the cast itself (`cast_peak_bytes`),
    the output gradient's two fp8 casts (tokens x hidden each, `float8_linear.py:113`, `:167`), the weight's fp8 cast
    (intermediate x hidden, `float8_linear.py:131`) and their scales."""
    tokens = plan.batch_size * plan.seq_len
    inter, hidden = spec.intermediate_size, spec.hidden_size
    scales = (scale_bytes(plan, tokens) + scale_bytes(plan, inter) + scale_bytes(plan, hidden)
              + scale_bytes(plan, inter))  # grad_output rows, weight rows, grad_output columns, input columns
    return {
        "gradients": tokens * inter * plan.precision.compute_bytes,
        "temporaries": cast_peak_bytes(tokens * inter) + 2 * FP8_BYTES * tokens * hidden + FP8_BYTES * inter * hidden
        + scales,
    }




def check(spec: ModelSpec, plan: TrainingPlan) -> None:
    """What the model must be for the walk's float8 moment (`llmem.walk.float8`): a dense llama-like family whose
    down_proj is converted (intermediate and hidden sizes divisible by 16); else a gap naming the fix."""
    from llmem.errors import GAP, InputError

    if not applies(plan):
        return
    from llmem.families import has_trait, with_trait

    if not has_trait(spec.model_type, "float8_linears") or spec.is_moe or spec.derived is not None:
        families = ", ".join(with_trait("float8_linears"))
        raise InputError("float8", f"float8 Linears are modelled for the dense {families} "
                         f"families; {spec.model_type!r} is not one: use --float8 none", GAP)
    if not converted(spec.intermediate_size, spec.hidden_size):
        raise InputError("float8", f"torchtitan's filter leaves down_proj ({spec.intermediate_size} -> "
                         f"{spec.hidden_size}, not both multiples of 16) in bf16, which is not modelled: use "
                         "--float8 none", GAP)
