"""The support rows of `--fsdp1-wrap adapters` (appended to `llmem.support.RULES`): the FSDP-LoRA recipes' wrap
(`llmem.components.flat_adapters`) is modelled and measured for LoRA and QLoRA under FULL_SHARD and SHARD_GRAD_OP
on 2+ GPUs, fp32 or pure bf16 with the adapters in the base's dtype, with q_proj, k_proj or v_proj adapted (the
layer's first adapter, whose pre-backward prefetches the layer below); the rest are gaps until measured."""

from __future__ import annotations

from llmem.choices import Engine, Float8, Method, Precision
from llmem.errors import GAP
from llmem.support_rule import Rule, _r


def _adapters(p) -> bool:
    return p.engine is Engine.FSDP1 and p.fsdp1_wrap.value == "adapters"


def _adapted(p) -> bool:
    return _adapters(p) and p.method in (Method.LORA, Method.QLORA)


def _attention_first(p) -> bool:
    """Whether q_proj, k_proj or v_proj is among the targets (all-linear included)."""
    targets = str(p.lora_targets)
    return "all-linear" in targets or any(t in targets for t in ("q_proj", "k_proj", "v_proj"))


FSDP1_WRAP_RULES: tuple[Rule, ...] = (
    _r("engine fsdp1_wrap method", "fsdp1-wrap", lambda p: _adapters(p) and p.method is Method.FULL,
       "--fsdp1-wrap adapters is modelled for --method lora and qlora (full fine-tuning has no adapters: the "
       "recipes' lambda policy would wrap every Linear and norm); use --fsdp1-wrap layers",
       GAP, engine="fsdp1", fsdp1_wrap="adapters", method="full", gpus=2, zero=3),
    _r("engine fsdp1_wrap method precision", "precision",
       lambda p: _adapted(p) and p.precision.is_mixed,
       "--fsdp1-wrap adapters under MixedPrecision is not modelled (with its defaults the run raises a dtype "
       "mismatch: PEFT casts lora_A's input to the sharded fp32 weight's dtype before the adapter's unit swaps in "
       "the half one); use --precision fp32 or bf16 with --lora-adapter-dtype base", GAP,
       engine="fsdp1", fsdp1_wrap="adapters", method="lora", precision="bf16-mixed", gpus=2, zero=3),
    _r("engine fsdp1_wrap method precision lora_adapter_dtype", "lora-adapter-dtype",
       lambda p: _adapted(p) and p.precision in (Precision.BF16, Precision.FP16)
       and p.lora_adapter_dtype.value == "fp32",
       "--fsdp1-wrap adapters with PEFT's fp32 adapters on a half base is not modelled (fp32 adapter units beside "
       "half layers); use --lora-adapter-dtype base (as the FSDP-LoRA recipes cast them)", GAP,
       engine="fsdp1", fsdp1_wrap="adapters", method="lora", precision="bf16", gpus=2, zero=3),
    _r("engine fsdp1_wrap method gpus zero", "zero", lambda p: _adapted(p)
       and (p.zero == 0 or p.gpus == 1),
       "--fsdp1-wrap adapters is modelled for FULL_SHARD and SHARD_GRAD_OP on 2+ GPUs; use --zero 3 or 2", GAP,
       engine="fsdp1", fsdp1_wrap="adapters", method="lora", precision="fp32", gpus=2, zero=0),
    _r("engine fsdp1_wrap method lora_targets", "lora-targets",
       lambda p: _adapted(p) and not _attention_first(p),
       "--fsdp1-wrap adapters is modelled with q_proj, k_proj or v_proj adapted (the first adapter's pre-backward "
       "prefetches the layer below); add one of them to --lora-targets", GAP,
       engine="fsdp1", fsdp1_wrap="adapters", method="lora", precision="fp32", lora_targets="o_proj", gpus=2,
       zero=3),
    _r("engine fsdp1_wrap method grad_accum keep_grads optimizer_in_backward float8 activation_offload pp cp",
       "fsdp1-wrap", lambda p: _adapted(p) and (
           p.grad_accum > 1 or p.keep_grads or p.optimizer_in_backward or p.float8 is not Float8.NONE
           or p.activation_offload or p.pp > 1 or p.cp > 1),
       "--fsdp1-wrap adapters is not modelled with gradient accumulation, kept gradients, the optimizer step in "
       "backward, float8, activation offload, pipeline or context parallelism; use --fsdp1-wrap layers", GAP,
       engine="fsdp1", fsdp1_wrap="adapters", method="lora", precision="fp32", grad_accum=2, gpus=2, zero=3),
)
