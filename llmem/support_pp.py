"""The support matrix's rows of pipeline parallelism (`llmem.support.RULES` takes them in its order): `--pp` and what
runs beside it (data parallelism, the methods, checkpointing, attention, optimizers). Each row as in `llmem.support`:
the fields it reads, the option it blames, its one-line message with the fix, REFUSED or GAP, and an example."""

from __future__ import annotations

from llmem.choices import Engine, FsdpShard, GradCkpt, Loss, Method, Offload, Optimizer, PpSchedule
from llmem.errors import GAP, REFUSED
from llmem.support_rule import _r

TORCH_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.SGD)
BNB_OPTIMIZERS = (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT)


def pipeline_rules() -> tuple:
    """The rows (`llmem.support_rule._r`): the pipeline's layout and schedule, then the options on its stages."""
    return _layout_rules() + _option_rules()


def _layout_rules() -> tuple:
    """The schedule, the microbatches and the GPUs: stages, and the data parallelism beside them."""
    return (
    # the rows keep the indentation of `llmem.support.RULES`, where they were
    _r("pp_schedule pp", "pp-schedule", lambda p: p.pp_schedule is not PpSchedule.ONE_F_ONE_B and p.pp == 1, "--pp-"
       "schedule {p.pp_schedule} needs pipeline stages; use --pp 2+ or leave it at 1f1b", REFUSED, pp_schedule="gpipe"),
    _r("microbatches pp", "microbatches", lambda p: p.microbatches != 1 and p.pp == 1,
       "--microbatches {p.microbatches} splits a pipeline's batch; use --pp 2 or more, or leave --microbatches at 1",
       REFUSED, microbatches=2),
    # --gpus = pp × dp: torchtitan's mesh, pipeline stages outer, data-parallel replicas of each stage inner
    _r("gpus pp", "pp", lambda p: p.pp > 1 and p.gpus % p.pp != 0,
       "--gpus {p.gpus} is not a multiple of --pp {p.pp} (each stage runs on gpus / pp data-parallel ranks); use "
       "--gpus {p.pp} or a multiple of it", REFUSED, pp=2, gpus=3, microbatches=2, batch_size=2),
    _r("pp tp zero engine", "pp", lambda p: p.pp > 1 and (p.tp > 1 or p.zero in (1, 2) or p.engine is not Engine.TORCH),
       "pipeline parallelism is modelled with DDP (--zero 0) or FSDP2 (--zero 3) beside it, not with TP, ZeRO-1/2, "
       "FSDP1 or DeepSpeed; use --tp 1 --zero 0 or 3 --engine torch", GAP, pp=2, gpus=2, zero=1, microbatches=2,
       batch_size=2),
    _r("gpus pp zero", "zero", lambda p: p.pp > 1 and p.zero == 3 and p.gpus == p.pp,
       "FSDP2 shards each stage over its data-parallel ranks; with --gpus {p.gpus} = --pp there are none: use --gpus "
       "{p.gpus} × 2 or more, or --zero 0", REFUSED, pp=2, gpus=2, zero=3, microbatches=2, batch_size=2),
    _r("gpus pp zero pp_schedule microbatches", "pp-schedule", lambda p: p.pp > 1 and p.gpus > p.pp and p.zero == 0
       and not (p.pp_schedule is PpSchedule.ONE_F_ONE_B and p.microbatches > p.pp), "DDP beside pipeline stages runs "
       "in torch 2.13 only where each stage runs a forward between its first two backwards (1F1B with more "
       "microbatches than stages): else the Reducer records its parameters twice and asserts at the next step's "
       "bucket rebuild (reducer.cpp:2003); use --pp-schedule 1f1b --microbatches {p.pp} + 1 or more, or --zero 3",
       REFUSED, pp=2, gpus=4, microbatches=2, batch_size=2),
    _r("pp zero pp_schedule microbatches", "zero", lambda p: p.pp > 1 and p.zero == 3 and (
        p.pp_schedule is PpSchedule.INTERLEAVED_1F1B or p.microbatches == 1), "FSDP2 beside pipeline stages is "
       "modelled with one stage per GPU (gpipe, 1f1b) and 2 or more microbatches; use them, or --zero 0", GAP, pp=2,
       gpus=4, zero=3, microbatches=1, batch_size=2, pp_schedule="gpipe"),
    _r("pp zero ddp_bucket_view fsdp_shard", "pp", lambda p: p.pp > 1 and (
        p.ddp_bucket_view or (p.zero == 3 and p.fsdp_shard is not FsdpShard.DIM0)), "pipeline stages are wrapped "
       "with DDP's default buckets and FSDP2's dim-0 shards; drop --ddp-bucket-view, use --fsdp-shard dim0", GAP,
       pp=2, gpus=4, microbatches=4, batch_size=4, ddp_bucket_view=True),
    _r("pp zero precision", "zero", lambda p: p.pp > 1 and p.zero == 3 and p.precision.is_mixed, "FSDP2 beside "
       "pipeline stages is modelled in fp32 or pure bf16/fp16 (not its MixedPrecisionPolicy); use one of them, or "
       "--zero 0", GAP, pp=2, gpus=4, zero=3, microbatches=2, batch_size=2, precision="bf16-mixed"),
    _r("batch_size microbatches pp", "microbatches", lambda p: p.pp > 1 and p.batch_size % p.microbatches,
       "--microbatches {p.microbatches} must divide --batch-size {p.batch_size} (the pipeline's step batch; "
       "torchtitan refuses a remainder)", REFUSED, pp=2, gpus=2, batch_size=3, microbatches=2),
    _r("pp pp_schedule microbatches", "microbatches",
       lambda p: p.pp > 1 and p.pp_schedule is PpSchedule.ONE_F_ONE_B and p.microbatches < p.pp,
       "Schedule1F1B needs at least as many microbatches as stages; use --microbatches {p.pp} or more, or "
       "--pp-schedule gpipe", REFUSED, pp=2, gpus=2),
    _r("pp_stages_per_rank pp_schedule", "pp-stages-per-rank", lambda p: p.pp_stages_per_rank != 2
       and p.pp_schedule is not PpSchedule.INTERLEAVED_1F1B, "--pp-stages-per-rank {p.pp_stages_per_rank} needs "
       "--pp-schedule interleaved-1f1b; use it, or leave it at 2", REFUSED, pp_stages_per_rank=3),
    _r("pp pp_schedule microbatches", "microbatches", lambda p: p.pp_schedule is PpSchedule.INTERLEAVED_1F1B
       and p.microbatches % max(1, p.microbatches // p.pp), "ScheduleInterleaved1F1B needs --microbatches a multiple"
       " of its rounds, max(1, M // pp) (schedules.py:2935-2942); use a multiple of --pp {p.pp}", REFUSED, pp=2,
       gpus=2, batch_size=5, microbatches=5, pp_schedule="interleaved-1f1b"),
    )


def _option_rules() -> tuple:
    """What runs on the stages: the method, checkpointing, attention, the optimizer, the loss and the step."""
    return (
    # LoRA on the stages (PEFT on the whole model, then split: `runtime.pipeline.Stage`; `components.pipeline_lora`)
    _r("pp method gpus lora_modules_to_save", "method", lambda p: p.pp > 1 and p.method is not Method.FULL and (
        p.method is not Method.LORA or p.gpus > p.pp or bool(p.lora_modules_to_save)), "pipeline parallelism is "
       "modelled for --method full, and lora with one stage per GPU (--gpus = --pp) and no --lora-modules-to-save; "
       "use one of them", GAP, pp=2, gpus=2, microbatches=2, batch_size=2, method="qlora"),
    _r("pp grad_ckpt ckpt_every", "grad-ckpt",
       lambda p: p.pp > 1 and (p.grad_ckpt is GradCkpt.SELECTIVE or p.ckpt_every > 1),
       "pipeline parallelism is modelled with --grad-ckpt none or full (every layer); use one of them", GAP, pp=2,
       gpus=2, microbatches=2, batch_size=2, grad_ckpt="selective"),
    _r("pp optimizer zero", "optimizer", lambda p: p.pp > 1 and (p.optimizer in BNB_OPTIMIZERS or (
        p.optimizer is Optimizer.ADAFACTOR and p.zero == 3)), "pipeline parallelism is modelled with adamw, sgd or "
       "adafactor (not on FSDP2's shards); use one of them", GAP, pp=2, gpus=2,
       microbatches=2, batch_size=2, optimizer="adamw8bit", optimizer_impl="default"),
    _r("pp loss grad_accum optimizer_in_backward offload keep_grads", "pp",
       lambda p: p.pp > 1 and (p.loss is not Loss.STANDARD or p.grad_accum > 1 or p.optimizer_in_backward
                               or p.offload is not Offload.NONE or p.keep_grads),
       "pipeline parallelism is modelled with the standard loss, one micro-step, the step after backward, no "
       "offload and gradients freed by zero_grad; use --pp 1, or drop --loss/--grad-accum/--optimizer-in-backward/"
       "--offload/--keep-grads", GAP, pp=2, gpus=2, microbatches=2, batch_size=2, grad_accum=2),
    )
