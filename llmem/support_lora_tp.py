"""The support matrix's rows for LoRA with tensor parallelism (appended to `llmem.support.RULES`).

What runs is TP first, PEFT after (`llmem.runtime.lora_tp`, transformers 5.23 `from_pretrained(tp_plan="auto")`
then peft 0.21.2 `get_peft_model`). PEFT's TP adapters run on column-parallel targets; on a row-parallel one
(o_proj, down_proj, ... — every plan has them, so `all-linear` always adapts one) the forward fails: a refusal. The
rest is a gap: not modelled or measured yet. A target whose style in the model's own plan is not "colwise" is
refused or named by the estimate (`llmem.derive.tp.lora_target_refusal`), which knows the model; on a mixture of
experts (mixtral, qwen2_moe, qwen3_moe: docs/MODEL-LORA-TP.md) the router and fused experts adapted under TP are a
gap named by `llmem.derive.lora.moe_refusal`."""

from __future__ import annotations

from llmem.choices import GradCkpt, Loss, Method
from llmem.errors import GAP, REFUSED
from llmem.optiontypes import ALL_LINEAR
from llmem.support_rule import _r

LORA_TP_ROWWISE = ("PEFT 0.21.2 sizes the lora_A of a row-parallel Linear (o_proj, down_proj, ...) from its local "
                   "shard (`_get_in_out_features`) and transformers 5.23's rowwise hook takes that local in_features "
                   "for the global one (`_from_local_last_dim_shard`): the forward fails")

LORA_TP_GATHERED = ("PEFT 0.21.2 installs TP hooks on colwise and rowwise Linears only (`peft/tuners/lora/model.py:"
                    "414-420`) and sizes the adapter from the local shard, while transformers 5.23 gathers the "
                    "base's output to the full width: the adapter's out/T output is added to it and the forward fails")


def _not_modelled(p) -> bool:
    return p.method is not Method.FULL and p.tp > 1 and (
        p.method is Method.QLORA or p.gpus > p.tp or p.grad_ckpt is not GradCkpt.NONE
        or bool(p.lora_modules_to_save) or p.grad_accum > 1 or p.loss is not Loss.STANDARD or p.keep_grads)


LORA_TP_RULES = (
    _r("method tp lora_targets", "lora-targets",
       lambda p: p.method is Method.LORA and p.tp > 1 and p.lora_targets == ALL_LINEAR,
       LORA_TP_ROWWISE + "; all-linear adapts them: name column-parallel targets, e.g. --lora-targets "
       "q_proj,k_proj,v_proj,gate_proj,up_proj, or use --tp 1", REFUSED, method="lora", gpus=2, tp=2, zero=0),
    _r("method tp gpus grad_ckpt precision lora_modules_to_save grad_accum loss keep_grads", "tp", _not_modelled,
       "{p.method} with tensor parallelism is modelled and measured for --method lora on --gpus = --tp, without "
       "checkpointing, --lora-modules-to-save, --grad-accum, --keep-grads or another loss (a "
       "quantized base split by TP, TP x FSDP2 and those not yet); use --tp 1, or those settings", GAP,
       method="qlora", quant="nf4",
       precision="bf16", gpus=2, tp=2, zero=0),
)
