"""The support rows of `--lora-adapter-dtype base` (appended to `llmem.support.RULES`): the adapters in a pure bf16
base's dtype are modelled and measured for LoRA on one GPU, DDP, FSDP2 and FSDP1 (`lora.base_dtype_adapters`); the
other programs that take a LoRA plan are gaps until measured with it. Traced LoRA tables (architectures outside the
hand-written families) are a model check: `check_model`."""

from __future__ import annotations

from llmem.choices import Engine, Float8, Method, Offload, Precision, Quant
from llmem.errors import GAP
from llmem.support_rule import Rule, _r


def _base(p) -> bool:
    return p.method in (Method.LORA, Method.QLORA) and p.lora_adapter_dtype.value == "base" \
        and p.precision in (Precision.BF16, Precision.FP16)


def _unmeasured(p) -> bool:
    # QLoRA: 4-bit, on one GPU (FSDP1's compute plan) and FSDP1
    qlora = p.method is Method.QLORA and (p.quant is Quant.INT8 or (p.engine is not Engine.FSDP1 and p.gpus > 1))
    return (p.precision is Precision.FP16 or qlora or p.engine is Engine.DEEPSPEED or p.tp > 1
            or p.pp > 1 or p.cp > 1 or p.offload is not Offload.NONE or p.activation_offload
            or p.float8 is not Float8.NONE or bool(p.lora_modules_to_save) or p.optimizer_in_backward)


LORA_DTYPE_RULES: tuple[Rule, ...] = (
    _r("method lora_adapter_dtype precision engine quant gpus tp pp cp offload activation_offload float8 "
       "lora_modules_to_save optimizer_in_backward", "lora-adapter-dtype", lambda p: _base(p) and _unmeasured(p),
       "--lora-adapter-dtype base is modelled for --method lora under pure bf16 on one GPU, DDP, FSDP2 and FSDP1 "
       "(--engine torch or fsdp1), without TP, pipeline, context parallelism, offload, float8, module copies or "
       "the optimizer step in backward, and for --method qlora --quant nf4|fp4 on one GPU and FSDP1 (--engine "
       "fsdp1); use --lora-adapter-dtype fp32 (PEFT's default)", GAP,
       method="lora", precision="fp16", lora_adapter_dtype="base"),
)


def check_model(spec, plan) -> None:
    """Traced LoRA tables (`spec.derived`: families without hand-written LoRA tables) and the mixtures of experts'
    with base-dtype adapters are not measured: a gap."""
    from llmem.components import lora
    from llmem.errors import InputError

    if lora.base_dtype_adapters(plan) and (spec.derived is not None or spec.is_moe):
        kind = "a mixture of experts" if spec.derived is None else "traced"
        raise InputError("lora-adapter-dtype", f"--lora-adapter-dtype base is measured on the hand-written dense "
                         f"LoRA tables (llama-like families); {spec.model_type!r} is {kind}: use "
                         "--lora-adapter-dtype fp32", GAP)
