"""The support rows of `--no-sync` (appended to `llmem.support.RULES`): the first K-1 micro-steps of `--grad-accum K`
without synchronizing, as accelerate 1.15 `Accelerator.accumulate`/`no_sync` (accelerator.py:1132-1178, 1255-1298)
and the HF Trainer (transformers 5.23 trainer.py:1896-1907) run them. It exists for DDP, ZeRO-1 (DDP under
ZeroRedundancyOptimizer), FSDP2 ZeRO-2/3 and FSDP1 on 2+ GPUs; DeepSpeed accumulates itself (accelerate skips its
engine's no_sync from ZeRO-2 on, accelerator.py:1175, and the Trainer never enters it, trainer.py:1899)."""

from __future__ import annotations

from llmem.choices import Engine, Method, Offload
from llmem.errors import GAP, REFUSED
from llmem.support_rule import Rule, _r

NO_SYNC_RULES: tuple[Rule, ...] = (
    _r("no_sync grad_accum", "no-sync", lambda p: p.no_sync and p.grad_accum == 1,
       "--no-sync skips the synchronization of the first K-1 micro-steps of --grad-accum K; use --grad-accum 2 or "
       "more, or leave --no-sync off", REFUSED, no_sync=True, gpus=2, grad_accum=1),
    _r("no_sync gpus tp zero engine", "no-sync", lambda p: p.no_sync and p.gpus == 1,
       "on one GPU there is nothing to synchronize; leave --no-sync off", REFUSED, no_sync=True, grad_accum=2),
    _r("no_sync engine", "no-sync", lambda p: p.no_sync and p.engine is Engine.DEEPSPEED,
       "DeepSpeed accumulates by itself (its engine refuses no_sync under ZeRO-2/3, and accelerate and the HF Trainer "
       "do not call it); leave --no-sync off", REFUSED, no_sync=True, engine="deepspeed", gpus=2, zero=2,
       grad_accum=2),
    _r("no_sync tp pp cp", "no-sync", lambda p: p.no_sync and (p.tp > 1 or p.pp > 1 or p.cp > 1),
       "--no-sync is modelled for data parallelism alone (DDP, ZeRO-1, FSDP2 ZeRO-2/3, FSDP1), not with TP, pipeline "
       "or context parallelism; use --tp 1 --pp 1 --cp 1, or leave --no-sync off", GAP, no_sync=True, gpus=4, tp=2,
       zero=3, grad_accum=2),
    _r("no_sync method lora_modules_to_save", "no-sync", lambda p: p.no_sync and (
        p.method is Method.QLORA or (p.method is Method.LORA and bool(p.lora_modules_to_save))),
       "--no-sync is measured for full fine-tuning and LoRA without module copies (not QLoRA); use --method full or "
       "lora without --lora-modules-to-save, or leave --no-sync off", GAP, no_sync=True, gpus=2, grad_accum=2,
       method="qlora", quant="nf4", precision="bf16"),
    _r("no_sync offload keep_grads ddp_bucket_view activation_offload", "no-sync",
       lambda p: p.no_sync and (p.offload is not Offload.NONE or p.keep_grads or p.ddp_bucket_view
                                or p.activation_offload),
       "--no-sync is not modelled with offload, kept gradients, --ddp-bucket-view or activation offload; drop them, or "
       "leave --no-sync off", GAP, no_sync=True, gpus=2, grad_accum=2, keep_grads=True),
)
