"""The quantized frozen base of `--method qlora` (bitsandbytes 4-bit, `llmem.runtime.lora.quantize_base`).

Every Linear of the base but the output layer becomes a `bnb.nn.Linear4bit` whose weight is a `Params4bit`
(bitsandbytes 0.50 `functional.quantize_4bit`, blocksize 64, no double quantization):
  packed weight: uint8, ceil(numel / 2) bytes (two 4-bit codes per byte);
  absmax: fp32, one per block of 64 elements -> 4 * ceil(numel / 64) bytes;
  code: the 16-entry fp32 nf4/fp4 lookup table, a new tensor per weight (`get_4bit_type`) -> 64 bytes.
Embeddings, the output layer and the norm weights stay in the plan's dtype.

Dequantization (`MatMul4Bit`: forward `gemm_4bit`, backward `matmul(grad_output, dequantize_4bit(W))`) makes the
full weight (out, in) in the compute dtype for one Linear at a time; it is freed when the matmul returns:
  cuda: the dequantize kernel writes the compute-dtype weight directly (numel * compute bytes);
  cpu: bitsandbytes' default implementation `_dequantize_4bit_compute` is wrapped in `torch.compile`, whose fused
  kernel allocates only its output, numel * compute bytes as well (measured). Where compilation fails (no C++
  compiler) bitsandbytes falls back to eager code with int32/fp32 intermediates (up to 8-10 B/elem): not modelled.
The largest such moment in a layer's backward: the dequantized weight, the Linear's output gradient and the input
gradient the matmul writes (`dequant_moment_bytes`); in the forward: the weight and the Linear's output.
"""

from __future__ import annotations

from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor

BLOCKSIZE = 64
CODE_BYTES = 16 * 4


def is_qlora(plan: TrainingPlan) -> bool:
    return plan.method is Method.QLORA


def quantized_weights(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """The base weights that are stored quantized (every Linear but the output layer)."""
    from llmem.components.lora import linear_weights

    return linear_weights(spec) if is_qlora(plan) else []


def storage_bytes(numel: int) -> int:
    """Bytes of one 4-bit weight: packed codes, fp32 absmax per block of 64, the 16-entry fp32 code table."""
    return -(-numel // 2) + 4 * -(-numel // BLOCKSIZE) + CODE_BYTES


def base_parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The frozen base: quantized Linears plus everything else in the plan's parameter dtype."""
    q = quantized_weights(spec, plan)
    plain = spec.total_params - sum(p.numel for p in q)
    return plain * plan.precision.param_bytes + sum(storage_bytes(p.numel) for p in q)


def dequant_forward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Forward: the largest decoder-layer Linear's dequantized weight plus its output (tokens, out)."""
    from llmem.components.lora import in_out

    tokens = plan.batch_size * plan.seq_len
    cb = plan.precision.compute_bytes
    return max((p.numel * cb + tokens * in_out(spec, p)[1] * cb
                for p in quantized_weights(spec, plan) if p.layer == 0), default=0)


def dequant_backward_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Backward: how far a Linear's dequantized weight can lift the modelled layer-backward moment.

    That moment (`gradients.layer_backward_peak_extra_bytes`) is the sum of a Linear's input gradient from its
    base matmul and the one from its LoRA branch (tokens, in). Measured order in `MatMul4BitBackward`: weight
    dequantized, input gradient written, weight freed, then the sum allocated. So the dequantized moment exceeds
    the modelled one by numel * cb - tokens * in * cb when positive (wide weights, few tokens). Measured on
    llama/qwen3 (fp32, CPU) within 0.7 %; an approximation for the Linears before the MLP output."""
    from llmem.components.lora import in_out

    tokens = plan.batch_size * plan.seq_len
    cb = plan.precision.compute_bytes
    layer = [p for p in quantized_weights(spec, plan) if p.layer == 0]
    if not layer:
        return 0
    # the last Linear of the forward (the MLP output) runs its backward first, with all of the layer alive; the
    # others run after its input (tokens, in) that its LoRA branch kept has been freed
    last_in = in_out(spec, layer[-1])[0]
    best = max(0, layer[-1].numel - tokens * last_in)
    for p in layer[:-1]:
        best = max(best, p.numel - tokens * (in_out(spec, p)[0] + last_in))
    return best * cb
