"""QLoRA on a traced architecture: the quantized frozen base the trace runs (bitsandbytes 0.50.2).

The trace quantizes the built fake model exactly as the measured step does (`llmem.runtime.lora.quantize_base`:
transformers' `replace_with_bnb_linear`, then `Params4bit(weight, ...).to(device)` per Linear), with bitsandbytes'
parameter classes re-classed onto fake tensors (`llmem.simulate.quant.fake_bnb_params`) and its quantization run by
its registered fake kernels (`bitsandbytes/_ops.py`). Every nn.Linear of the inventory but the output layer becomes a
`Linear4bit`, whichever family: fused projections (gpt_neox's `query_key_value`, phi's `dense`) included.

What a 4-bit Linear keeps and makes (bitsandbytes 0.50.2 `autograd/_functions.py: MatMul4Bit`):
- saved for backward: nothing through `save_for_backward` — `ctx.tensors = (None, B)` keeps the packed weight (a
  parameter), `ctx.state` its quant_state; the LoRA branch's saved tensors are PEFT's, as under `--method lora`.
- forward: `torch.ops.bitsandbytes.gemm_4bit`, whose CPU kernel is bitsandbytes' default one
  (`backends/default/ops.py: _gemm_4bit_default_impl`): with double quantization the fp32 absmax rebuilt
  (`dequantize_blockwise(...) + offset`), then `dequantize_4bit` writes the weight (out, in) in the compute dtype and
  `F.linear` the output; the weight is freed when the kernel returns. The registered fake kernel allocates the output
  only, so the trace runs the default kernel itself (`default_gemm_4bit`): its ops dispatch one by one and the
  tracker sees each temporary.
- backward: `torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype))`: the dequantized
  weight (and with double quantization the rebuilt absmax before it) live during the input gradient's matmul, freed
  when it returns; the fake `dequantize_4bit` allocates that weight as the real kernel does, so the layers'
  traced backward windows (and a checkpointed layer's recompute) hold it where the real step does.
The storage (packed codes, absmax, code tables) is counted from the inventory (`llmem.components.quant`).
"""

from __future__ import annotations

import contextlib


def method_tag(plan) -> str:
    """The first field of `llmem.derive.lora.trace_key`: "lora", or the quantized base of `--method qlora`."""
    from llmem.plan import Method

    if plan.method is not Method.QLORA:
        return "lora"
    return f"qlora {plan.quant}{' double-quant' if plan.double_quant else ''}"


def quantize(model, tag: str):
    """The built fake model with its base quantized as `llmem.runtime.lora.quantize_base` does for the plan of
    `tag` (`method_tag`), in the model's own dtype (QLoRA's compute dtype: a pure precision)."""
    import torch

    from llmem.plan import TrainingPlan
    from llmem.runtime.lora import quantize_base
    from llmem.simulate.quant import fake_bnb_params

    _, quant, *rest = tag.split()
    dtype = model.get_input_embeddings().weight.dtype
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    plan = TrainingPlan(method="qlora", quant=quant, double_quant=bool(rest), precision=precision)
    with fake_bnb_params(plan):
        return quantize_base(model, plan)


def preload(lora: tuple | None) -> None:
    """bitsandbytes' import-time tensors made before the fake mode starts (`llmem.simulate.patches.preload_imports`);
    `lora`: `llmem.derive.lora.trace_key`'s fields, or None."""
    if lora is not None and lora[0] != "lora":
        from llmem.plan import TrainingPlan
        from llmem.simulate.patches import preload_imports

        preload_imports(TrainingPlan(method="qlora", quant=lora[0].split()[1], precision="fp32"))


@contextlib.contextmanager
def default_gemm_4bit(model):
    """While tracing a 4-bit base: `torch.ops.bitsandbytes.gemm_4bit.default` (called by `MatMul4Bit.forward`) runs
    bitsandbytes' default kernel, op by op (see the module docstring)."""
    if not getattr(getattr(model, "base_model", model), "is_loaded_in_4bit", False) and \
            not getattr(model, "is_loaded_in_4bit", False):
        yield
        return
    from unittest import mock

    import torch
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    class _Packet:
        default = staticmethod(_gemm_4bit_default_impl)

    with mock.patch.object(torch.ops.bitsandbytes, "gemm_4bit", _Packet):
        yield


def unconverted_linears(config: dict) -> frozenset[str]:
    """The names (last component) of the model's modules with a 2-D weight that transformers' bitsandbytes
    replacement leaves in the plan's dtype: `replace_with_bnb_linear` converts `type(module) is nn.Linear` and Conv1D
    only (transformers 5.23 `integrations/bitsandbytes.py:189`), so e.g. falcon's `FalconLinear` projections stay
    unquantized, frozen, with their LoRA adapters, and so do a mixture of experts' routers (`GptOssTopKRouter`'s
    `mlp.router`, `GraniteMoeTopKRouter`'s `block_sparse_moe.router`: modules of their own holding an
    `nn.Parameter` weight) and fused experts (3-D parameters, never in `linear_weights`). The bitsandbytes quantizer
    quantizes only the weights of the modules it replaced (`quantizers/quantizer_bnb_4bit.py:83-87`,
    `param_needs_quantization`: `isinstance(module, bnb.nn.Linear4bit)`). Counted on the meta device, cached on
    disk."""
    from llmem.derive import cache

    cached = cache.load(config, ("unconverted weights",))
    if cached is None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.pytorch_utils import Conv1D

        from llmem.plan import TrainingPlan
        from llmem.quiet import quiet_libraries
        from llmem.runtime.model import hf_config

        with quiet_libraries(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(config, TrainingPlan()), trust_remote_code=False)
        converted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if type(m) is torch.nn.Linear or isinstance(m, Conv1D)}
        kept = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() == 2
                and type(m) is not torch.nn.Linear and not isinstance(m, (Conv1D, torch.nn.Embedding))}
        cached = cache.store(config, ("unconverted weights",), {"names": sorted(kept - converted)})
    return frozenset(cached["names"])
