"""The support matrix's rows for `--float8` (torchao float8 training, `llmem.components.float8`), appended to
`llmem.support.RULES`: what is modelled is pure bf16 full fine-tuning without checkpointing on one GPU, DDP or
ZeRO-1, with PyTorch's own programs; the rest is a gap, or refused where the real program cannot run."""

from __future__ import annotations

from llmem.choices import Engine, Float8, GradCkpt, Loss, Method, Offload, Precision, Scheme
from llmem.errors import GAP, REFUSED
from llmem.support import _r

_ON = Float8.NONE


def _on(p) -> bool:
    return p.float8 is not _ON


RULES_FLOAT8 = (
    # Float8Linear reads the CUDA autocast dtype (float8_linear.py:258-262); fp32 and fp16 run, unmeasured
    _r("float8 precision", "float8", lambda p: _on(p) and p.precision is not Precision.BF16,
       "float8 Linears are modelled in pure bf16 (torchtitan's compute dtype); {p.precision} is not modelled: use "
       "--precision bf16, or --float8 none", GAP, float8="tensorwise", precision="fp32"),
    # bitsandbytes' Linear4bit / Linear8bitLt subclass nn.Linear: the swap would drop their quantized weights
    _r("float8 method", "float8", lambda p: _on(p) and p.method is Method.QLORA,
       "a qlora base is stored by bitsandbytes; float8 training converts bf16 Linears; use --method full, or "
       "--float8 none", REFUSED, float8="tensorwise", precision="bf16", method="qlora", quant="nf4"),
    _r("float8 method", "float8", lambda p: _on(p) and p.method is not Method.FULL,
       "float8 Linears under LoRA adapters are not modelled; use --method full, or --float8 none", GAP,
       float8="tensorwise", precision="bf16", method="lora"),
    _r("float8 gpus tp zero pp engine", "float8", lambda p: _on(p) and (
        p.scheme not in (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1) or p.engine is not Engine.TORCH),
       "float8 Linears are modelled on one GPU, DDP and ZeRO-1 (FSDP2's float8 all-gather, float8 tensor parallelism, "
       "pipelines, FSDP1 and DeepSpeed are not); use --zero 0 or 1 with --tp 1, or --float8 none", GAP,
       float8="tensorwise", precision="bf16", gpus=2, zero=3),
    _r("float8 grad_ckpt grad_accum keep_grads optimizer_in_backward offload loss ddp_bucket_view", "float8",
       lambda p: _on(p) and (p.grad_ckpt is not GradCkpt.NONE or p.grad_accum > 1 or p.keep_grads
                             or p.optimizer_in_backward or p.offload is not Offload.NONE
                             or p.loss is not Loss.STANDARD or p.ddp_bucket_view),
       "float8 Linears are modelled with --grad-ckpt none, --grad-accum 1, the standard loss, the step after backward "
       "with gradients freed by zero_grad, no offload and no DDP bucket views; drop those, or use --float8 none", GAP,
       float8="tensorwise", precision="bf16", grad_ckpt="full"),
)
