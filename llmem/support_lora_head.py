"""The support matrix's row for LoRA on the output layer (`--lora-targets ...,lm_head`; appended to
`llmem.support.RULES`). What is modelled and measured (`llmem.components.lora_head`): `--method lora` on one
device or DDP, fp32 or bf16-mixed, the standard loss, no checkpointing, accumulation, offload or in-backward step;
the rest is a gap."""

from __future__ import annotations

from llmem.choices import Engine, GradCkpt, Loss, Method, Offload, Precision, Scheme
from llmem.errors import GAP
from llmem.optiontypes import ALL_LINEAR
from llmem.support_rule import _r

_HEADS = ("lm_head", "embed_out")


def _names_head(p) -> bool:
    return p.method is not Method.FULL and p.lora_targets != ALL_LINEAR and any(
        t.rsplit(".", 1)[-1] in _HEADS for t in p.lora_targets.split(","))


def _not_modelled(p) -> bool:
    return _names_head(p) and (
        p.method is Method.QLORA or p.scheme not in (Scheme.SINGLE, Scheme.DDP)
        or p.precision not in (Precision.FP32, Precision.BF16_MIXED)
        or p.grad_ckpt is not GradCkpt.NONE or p.grad_accum > 1 or p.loss is not Loss.STANDARD
        or p.offload is not Offload.NONE or p.optimizer_in_backward or p.activation_offload
        or p.engine is not Engine.TORCH or bool(p.lora_modules_to_save) or p.keep_grads)


LORA_HEAD_RULES = (
    _r("method lora_targets gpus tp zero pp precision grad_ckpt grad_accum loss offload optimizer_in_backward "
       "activation_offload engine lora_modules_to_save keep_grads", "lora-targets", _not_modelled,
       "LoRA on the output layer (lm_head) is modelled and measured for --method lora on one GPU or DDP, in "
       "fp32 or bf16-mixed, without "
       "checkpointing, --grad-accum, offload, --optimizer-in-backward, --lora-modules-to-save, --keep-grads or "
       "another loss or engine (QLoRA, ZeRO-1/2/3, TP, PP, bf16, fp16 and those not yet); leave lm_head out of "
       "--lora-targets, or use those settings", GAP, method="lora", lora_targets="q_proj,v_proj,lm_head", gpus=2,
       zero=3),
)
