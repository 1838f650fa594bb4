"""QLoRA under autocast (`--method qlora --quant nf4|fp4 --precision bf16-mixed|fp16-mixed`, docs/MODEL-QLORA-MIXED.md).

What runs: the base built in fp32 (its norms, embeddings and lm_head stay fp32, as PEFT's
`prepare_model_for_kbit_training` leaves them), every decoder Linear a `bnb.nn.Linear4bit` whose
`bnb_4bit_compute_dtype` is the half dtype, fp32 adapters, the forward under `torch.autocast(half)`.
`Linear4bit.forward` (bitsandbytes 0.50.2 nn/modules.py:123-134) casts its input to the compute dtype itself
(`x = x.to(self.compute_dtype)`), runs `matmul_4bit` (a custom autograd Function over the `gemm_4bit` op, which
autocast does not touch: the packed weight is dequantized in the half dtype, no weight copy is cached or saved) and
casts the result back to its input's dtype (`.to(inp_dtype)`). So:
- no autocast weight copies of the decoder Linears (`autocast.weight_copy_bytes` leaves the quantized ones out);
- a 4-bit Linear fed by an fp32 tensor (a norm's output: llama's RMSNorm returns `weight * x.to(input_dtype)`,
  fp32 weight and fp32 stream) returns fp32: gate/up and what the MLP saves of them, qwen3's q_norm/k_norm, are
  fp32 (`fp32_output_items`); one fed by sdpa's half output (o_proj) returns half, as under --method lora;
- PEFT's `Linear4bit.forward` (peft 0.21.2 tuners/lora/bnb.py:215-240) clones the base output and, autocast being
  on, runs the adapters without casting: lora_A's autocast input casts are those of --method lora.
`--quant int8` under autocast is not this program (`MatMul8bitFp` dequantizes to its input's dtype and calls
`F.linear`, which autocast casts): not modelled.
"""

from __future__ import annotations

from llmem.plan import Method, Quant, TrainingPlan

FP32 = 4
# the llama table's entries made from a 4-bit Linear's output before any autocast op (layer_tables.py)
FP32_OUTPUTS = frozenset({"gate_proj", "silu(gate)", "up_proj", "silu(gate) * up",
                          "q_norm.normalized", "k_norm.normalized"})


def applies(plan: TrainingPlan) -> bool:
    """QLoRA with a 4-bit base under torch.autocast."""
    from llmem.components import autocast

    return plan.method is Method.QLORA and plan.quant in (Quant.NF4, Quant.FP4) and autocast.applies(plan)


def fp32_output_items(items: list, plan: TrainingPlan) -> list:
    """The llama-family table with the entries of `FP32_OUTPUTS` in fp32 (`.to(inp_dtype)`, module docstring)."""
    from llmem.components.activations import Saved

    if not applies(plan):
        return items
    cb = plan.precision.compute_bytes
    return [Saved(s.name, s.bytes * FP32 // cb) if s.name in FP32_OUTPUTS else s for s in items]


def mlp_bytes(plan: TrainingPlan) -> int:
    """Bytes per element of the MLP's tensors (gate/up outputs, their product, down_proj's output) and of their
    gradients in a layer's backward: fp32 under `applies` (`fp32_output_items`; a gradient has its tensor's dtype:
    the base's half input gradient, `MatMul4Bit.backward`, bitsandbytes autograd/_functions.py:384, is cast back by
    the `x.to(compute_dtype)` node, the adapter's by autocast's input cast node), else the compute dtype's."""
    return FP32 if applies(plan) else plan.precision.compute_bytes


def down_adapter_done_bytes(spec, plan: TrainingPlan) -> int:
    """At the `silu(gate) * up` backward (`lora_activations.mlp_backward_gradient_bytes`, whose fp32 gradients make
    it a layer's backward peak here): down_proj's adapter has run its backward, so its lora_A output (lora_B's saved
    input, T x r half) and the half weight casts its mms saved (r x (in + out)) are freed too (measured: llama,
    1x32 tokens, intermediate 512). (The same holds under --method lora with autocast, whose half MLP gradients
    seldom make this moment the peak: left as measured there.)"""
    from llmem.components.lora import _module, in_out, layer0_targeted

    if not applies(plan):
        return 0
    down = [p for p in layer0_targeted(spec, plan) if _module(p).rsplit(".", 1)[-1] == "down_proj"]
    if not down:
        return 0
    tokens, (inp, out) = plan.batch_size * plan.seq_len, in_out(spec, down[0])
    return (tokens * plan.lora_rank + plan.lora_rank * (inp + out)) * plan.precision.compute_bytes
