"""The support matrix's rows for `--float8` (torchao float8 training, `llmem.components.float8`), appended to
`llmem.support.RULES`: what is modelled is full fine-tuning in bf16 compute without checkpointing on one GPU, DDP,
ZeRO-1 or FSDP2, with PyTorch's own programs; the rest is a gap, or refused where the real program cannot run."""

from __future__ import annotations

from llmem.choices import Engine, Float8, GradCkpt, Loss, Method, Offload, Precision, Scheme
from llmem.errors import GAP, REFUSED
from llmem.support_rule import _r

_ON = Float8.NONE


def _on(p) -> bool:
    return p.float8 is not _ON


RULES_FLOAT8 = (
    # Float8Linear reads the CUDA autocast dtype (float8_linear.py:258-262); fp32 and fp16 run, unmeasured
    _r("float8 precision", "float8",
       lambda p: _on(p) and p.precision not in (Precision.BF16, Precision.BF16_MIXED),
       "float8 Linears are modelled in bf16 compute; {p.precision} is not modelled: use --precision bf16, or "
       "--float8 none", GAP, float8="tensorwise", precision="fp32"),
    _r("float8 precision gpus tp zero", "float8", lambda p: _on(p) and p.precision is Precision.BF16_MIXED
       and p.scheme not in (Scheme.ZERO2, Scheme.ZERO3),
       "float8 Linears under autocast are not modelled (bf16-mixed is, under FSDP2's MixedPrecisionPolicy): use "
       "--precision bf16, --zero 2 or 3, or --float8 none", GAP, float8="tensorwise", precision="bf16-mixed",
       gpus=2, zero=0),
    # bitsandbytes' Linear4bit / Linear8bitLt subclass nn.Linear: the swap would drop their quantized weights
    _r("float8 method", "float8", lambda p: _on(p) and p.method is Method.QLORA,
       "a qlora base is stored by bitsandbytes; float8 training converts bf16 Linears; use --method full, or "
       "--float8 none", REFUSED, float8="tensorwise", precision="bf16", method="qlora", quant="nf4"),
    _r("float8 method", "float8", lambda p: _on(p) and p.method is not Method.FULL,
       "float8 Linears under LoRA adapters are not modelled; use --method full, or --float8 none", GAP,
       float8="tensorwise", precision="bf16", method="lora"),
    _r("float8 gpus tp zero pp engine", "float8", lambda p: _on(p) and (
        p.scheme not in (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1, Scheme.ZERO2, Scheme.ZERO3)
        or p.engine is not Engine.TORCH),
       "float8 Linears are modelled on one GPU, DDP, ZeRO-1 and FSDP2 ZeRO-2/3 (float8 tensor parallelism, pipelines, "
       "FSDP1 and DeepSpeed are not); use --tp 1, --pp 1 and --engine torch, or --float8 none", GAP,
       float8="tensorwise", precision="bf16", pp=2, gpus=2, microbatches=2, batch_size=2),
    _r("float8 grad_ckpt grad_accum keep_grads optimizer_in_backward offload loss ddp_bucket_view", "float8",
       lambda p: _on(p) and (p.grad_ckpt is not GradCkpt.NONE or p.grad_accum > 1 or p.keep_grads
                             or p.optimizer_in_backward or p.offload is not Offload.NONE
                             or p.loss is not Loss.STANDARD or p.ddp_bucket_view),
       "float8 Linears are modelled with --grad-ckpt none, --grad-accum 1, the standard loss, the step after backward "
       "with gradients freed by zero_grad, no offload and no DDP bucket views; drop those, or use --float8 none", GAP,
       float8="tensorwise", precision="bf16", grad_ckpt="full"),
)
