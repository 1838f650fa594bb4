"""The support matrix: which combinations of plan options are refused, and why, as one table (`RULES`).

Each row names the plan fields its condition reads, the option the refusal blames, the one-line message with its
fix, and its kind: a right refusal (`REFUSED`: the real program cannot run it, e.g. Liger's Triton kernels on CPU)
or a gap (`GAP`: it could run, llmem does not model it yet). The rows are model-independent (the model's checks:
`llmem.estimate.validate_plan_for_model`); the pipeline's, `--cp`'s, `--float8`'s, LoRA with TP's and
`--activation-offload`'s rows are in `llmem.support_pp`, `support_cp`, `support_float8`, `support_lora_tp`,
`support_activation` (each made with `llmem.support_rule`). `TrainingPlan` raises the first row whose condition
holds (`check`); link repair (`llmem.share`) asks the rows over the options it changes
(`first_refusal`, `among`); tests run each row's example (`Rule.example`: fields tripping it, no row before) in both.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmem.choices import (
    Device,
    Engine,
    FsdpShard,
    GradCkpt,
    Loss,
    Method,
    Offload,
    Optimizer,
    OptimizerImpl,
    Quant,
    Scheme,
)
from llmem.errors import GAP, REFUSED, InputError
from llmem.support_activation import activation_offload_rules
from llmem.support_cp import context_parallel_rules
from llmem.support_float8 import RULES_FLOAT8
from llmem.support_fsdp1_wrap import FSDP1_WRAP_RULES
from llmem.support_lora_dtype import LORA_DTYPE_RULES
from llmem.support_lora_head import LORA_HEAD_RULES
from llmem.support_lora_tp import LORA_TP_RULES
from llmem.support_no_sync import NO_SYNC_RULES
from llmem.support_pp import BNB_OPTIMIZERS, TORCH_OPTIMIZERS, pipeline_rules
from llmem.support_rule import Rule, _r

LORA_METHODS = (Method.LORA, Method.QLORA)


_BNB_TP = ("{p.optimizer.value} does not run on tensor parallelism's DTensor parameters (bitsandbytes' update kernels "
           "have no sharding rule; Adafactor's in-place pow_ on a partial norm); use --tp 1, or --optimizer adamw|sgd")
_OFFLOAD_FSDP = ("optimizer+params runs FSDP2's CPUOffloadPolicy, modelled for --zero 2 or 3 with --tp 1 on 2 or "
                 "more GPUs; use that, or --offload none")

RULES: tuple[Rule, ...] = (
    # --- the strategy: GPU count, tensor parallelism, ZeRO stage -------------------------------------------------
    _r("gpus tp", "tp", lambda p: p.gpus % p.tp != 0, "TP degree {p.tp} must divide the GPU count {p.gpus}", REFUSED,
       gpus=3, tp=2),
    _r("gpus zero engine", "zero", lambda p: p.gpus == 1 and p.zero != 0 and p.engine is not Engine.DEEPSPEED,
       "ZeRO shards across GPUs; with --gpus 1 use --zero 0 (or --engine deepspeed)", REFUSED, gpus=1, zero=1),
    _r("gpus tp zero", "zero", lambda p: p.tp > 1 and p.gpus == p.tp and p.zero != 0,
       "with --tp {p.tp} on {p.gpus} GPUs there is no data-parallel group to shard over; use --zero 0, or more GPUs "
       "with --zero 3", REFUSED, gpus=2, tp=2, zero=3),
    # 2-D DDP over TP groups would run; the runtime and the estimate model FSDP2 across the TP groups only
    _r("gpus tp zero", "zero", lambda p: p.tp > 1 and p.gpus > p.tp and p.zero != 3,
       "TP combined with data parallelism runs FSDP2 across the TP groups; use --zero 3", GAP, gpus=4, tp=2, zero=1),
    # --- pipeline parallelism (torch.distributed.pipelining; llmem.walk.pipeline): llmem.support_pp ----------------
    *pipeline_rules(),
    # --- context parallelism (torch's ring attention; llmem.runtime.context_parallel): llmem.support_cp ---------
    *context_parallel_rules(),
    # --- the engine: PyTorch's own programs, FSDP1 (FullyShardedDataParallel), DeepSpeed ZeRO-0/1/2/3 -----------
    _r("engine gpus tp zero", "engine", lambda p: p.engine is Engine.DEEPSPEED and p.tp > 1,
       "DeepSpeed ZeRO has no tensor parallelism of its own (AutoTP is not modelled); use --tp 1, or --engine torch",
       GAP, engine="deepspeed", gpus=4, tp=2, zero=3),
    _r("engine precision", "precision",
       lambda p: p.engine is Engine.DEEPSPEED and p.precision.value not in ("fp32", "bf16-mixed"),
       "deepspeed is modelled in fp32 and bf16-mixed (bf16 weights, fp32 master partitions); its fp16 loss-scaled "
       "optimizer (unmeasured: DeepSpeed's CPU accelerator refuses fp16 without oneDNN fp16, engine.py:1391) and "
       "pure half weights are not; use --precision fp32 or bf16-mixed", GAP,
       engine="deepspeed", precision="fp16-mixed", gpus=2, zero=2),
    _r("engine method precision zero lora_modules_to_save grad_ckpt lora_dropout", "engine", lambda p: p.engine is
       Engine.DEEPSPEED and p.method is not Method.FULL and (
           p.method is not Method.LORA or p.precision.value not in ("fp32", "bf16-mixed")
           or (bool(p.lora_modules_to_save) and p.zero == 3) or (
               p.precision.value == "bf16-mixed" and p.grad_ckpt is not GradCkpt.NONE and not p.lora_dropout
               and p.zero != 3)),
       "{p.method} under DeepSpeed is modelled as LoRA in fp32 or bf16-mixed (checkpointed bf16 only with "
       "--lora-dropout > 0: with 0 a recomputed layer of the engine's bf16 adapters reads up to +0.85%), "
       "--lora-modules-to-save under ZeRO-0/1/2 (under ZeRO-3 the copy's frozen original is never gathered: not "
       "modelled); use that, --method full, or --engine torch", GAP,
       engine="deepspeed", method="lora", precision="bf16-mixed", gpus=2, zero=1, grad_ckpt="full", lora_dropout=0.0),
    # ZeRO-3 partitions the frozen base too; a frozen parameter released before its layer's recompute is recomputed
    # empty (deepspeedai/DeepSpeed#8148, merged after 0.19.0): torch's non-reentrant checkpoint raises
    _r("engine method zero grad_ckpt", "grad-ckpt", lambda p: p.engine is Engine.DEEPSPEED and p.method is Method.LORA
       and p.zero == 3 and p.grad_ckpt is not GradCkpt.NONE,
       "LoRA under DeepSpeed 0.19.0's ZeRO-3 cannot checkpoint: a frozen parameter released before its layer's "
       "recompute is recomputed empty and torch's checkpoint raises 'Recomputed values ... different metadata' "
       "(fixed after 0.19.0, deepspeedai/DeepSpeed#8148); use --grad-ckpt none, or ZeRO-0/1/2", REFUSED,
       engine="deepspeed", method="lora", gpus=2, zero=3, grad_ckpt="full"),
    _r("engine method zero ds_overlap_comm lora_dropout grad_ckpt", "lora-dropout", lambda p: p.engine is
       Engine.DEEPSPEED and p.method is Method.LORA and (p.zero == 2 or p.ds_overlap_comm) and p.lora_dropout > 0
       and p.grad_ckpt is not GradCkpt.NONE,
       "LoRA under DeepSpeed ZeRO-2 / overlap_comm with --lora-dropout > 0 is measured without checkpointing (the "
       "dropout's saves in a recomputed layer are not); use --grad-ckpt none, --lora-dropout 0, or ZeRO-0/1 "
       "without overlap_comm", GAP, engine="deepspeed", method="lora", precision="fp32", gpus=2, zero=2,
       grad_ckpt="full"),
    _r("engine offload", "engine", lambda p: p.engine is Engine.DEEPSPEED and p.offload is not Offload.NONE,
       "DeepSpeed's offload_optimizer / offload_param (DeepSpeedCPUAdam, pinned host buffers) are not modelled; "
       "use --offload none, or --engine torch", GAP, engine="deepspeed", offload="optimizer+params", gpus=2, zero=2),
    _r("engine optimizer", "engine", lambda p: p.engine is Engine.DEEPSPEED and p.optimizer in BNB_OPTIMIZERS,
       "{p.optimizer.value} as DeepSpeed's client optimizer is not modelled; use --optimizer adamw/sgd/adafactor", GAP,
       engine="deepspeed", optimizer="adamw8bit", gpus=2, zero=2),
    _r("engine fsdp_shard", "fsdp-shard",
       lambda p: p.engine is Engine.DEEPSPEED and p.fsdp_shard is not FsdpShard.DIM0,
       "--fsdp-shard chooses FSDP2's shard dim; DeepSpeed partitions one flat buffer per parameter group; use "
       "--fsdp-shard dim0", REFUSED, engine="deepspeed", fsdp_shard="dim1-if-short", gpus=2, zero=2),
    _r("engine keep_grads optimizer_in_backward", "engine", lambda p: p.engine is Engine.DEEPSPEED and (
       p.keep_grads or p.optimizer_in_backward), "kept gradients and an optimizer in backward under DeepSpeed are "
       "not modelled; no --keep-grads or --optimizer-in-backward, or --engine torch", GAP, engine="deepspeed",
       keep_grads=True, gpus=2, zero=1),
    _r("engine loss", "engine", lambda p: p.engine is Engine.DEEPSPEED and p.loss is not Loss.STANDARD,
       "{p.loss.value} under DeepSpeed is not modelled; use --loss standard", GAP, engine="deepspeed",
       loss="fused-linear-ce", gpus=2, zero=2),
    _r("ds_reduce_bucket engine", "ds-reduce-bucket",
       lambda p: p.ds_reduce_bucket != 500_000_000 and p.engine is not Engine.DEEPSPEED,
       "--ds-reduce-bucket {p.ds_reduce_bucket} sets DeepSpeed ZeRO's reduce_bucket_size; use --engine deepspeed, or "
       "leave it at 500000000", REFUSED, ds_reduce_bucket=1000),
    _r("ds_overlap_comm engine", "ds-overlap-comm", lambda p: p.ds_overlap_comm and p.engine is not Engine.DEEPSPEED,
       "--ds-overlap-comm sets DeepSpeed's overlap_comm; use --engine deepspeed", REFUSED, ds_overlap_comm=True),
    *(_r(f"{f} engine zero", f.replace("_", "-"), lambda p, f=f, d=d: getattr(p, f) != d and (
        p.engine is not Engine.DEEPSPEED or p.zero != 3), f"--{f.replace('_', '-')} sets DeepSpeed's {key}; use "
        f"--engine deepspeed --zero 3, or leave it at {d}", REFUSED, **{f: 1000}) for f, key, d in (
        ("ds_prefetch_bucket", "stage3_prefetch_bucket_size", 50_000_000),
        ("ds_persistence_threshold", "stage3_param_persistence_threshold", 100_000))),
    _r("engine gpus tp zero", "engine", lambda p: p.engine is Engine.FSDP1 and p.tp > 1,
       "FSDP1 with tensor parallelism is not modelled; use --tp 1, or --engine torch (TP x FSDP2)", GAP,
       engine="fsdp1", gpus=2, tp=2, zero=0),
    _r("engine gpus tp zero", "engine", lambda p: p.engine is Engine.FSDP1 and p.zero == 1,
       "fsdp1 runs --zero 0 (NO_SHARD), 2 (SHARD_GRAD_OP) and 3 (FULL_SHARD); FSDP1 has no ZeRO-1 (its optimizer "
       "states shard with the parameters); use --zero 0, 2 or 3, or --engine torch (ZeroRedundancyOptimizer)",
       REFUSED, engine="fsdp1", gpus=2, zero=1),
    _r("engine method precision quant", "engine", lambda p: p.engine is Engine.FSDP1 and p.method is Method.QLORA
       and (p.quant is Quant.INT8 or p.precision.is_mixed or p.precision.param_bytes != 2),
       "{p.method} under FSDP1 is modelled as FSDP-QLoRA recipes run it: pure bf16 with the 4-bit codes "
       "stored in that dtype (bnb_4bit_quant_storage; FSDP1 cannot flatten uint8 or int8 codes); use --precision "
       "bf16 --lora-adapter-dtype base with --quant nf4 or fp4, or --engine torch (FSDP2)", GAP,
       engine="fsdp1", method="qlora", quant="nf4", precision="fp32", gpus=2, zero=3),
    # SHARD_GRAD_OP keeps a layer's unsharded views from forward into backward (`_skipped_use_sharded_views`), and
    # `_writeback_orig_params` (torch 2.13 fsdp/_flat_param.py:2311-2321) asserts the module still holds them; but
    # `Linear4bit.forward` re-registers its weight as a `Params4bit` (bitsandbytes 0.50.2 nn/modules.py:499-500)
    _r("engine method zero", "zero", lambda p: p.engine is Engine.FSDP1 and p.method is Method.QLORA and p.zero == 2
       and p.gpus > 1, "FSDP1 SHARD_GRAD_OP raises 'FSDP does not support changing the parameters between forward "
       "and backward' over a 4-bit base (bitsandbytes' Linear4bit.forward re-registers its weight as a Params4bit, "
       "and SHARD_GRAD_OP keeps the forward's views into backward); use --zero 3 (FULL_SHARD) or 0 (NO_SHARD)",
       REFUSED, engine="fsdp1", method="qlora", quant="nf4", precision="bf16", lora_adapter_dtype="base", gpus=2,
       zero=2),
    # PEFT's fp32 adapters beside the half codes and norms: two dtypes in one unit (as LoRA's row below)
    _r("engine method precision lora_adapter_dtype", "lora-adapter-dtype",
       lambda p: p.engine is Engine.FSDP1 and p.method is Method.QLORA and p.lora_adapter_dtype.value == "fp32",
       "FSDP1 flattens a decoder layer into one FlatParameter of one dtype, and PEFT keeps the adapters of a "
       "{p.precision.value} 4-bit base in fp32 (FSDP1 raises 'Must flatten tensors with uniform dtype'); use "
       "--lora-adapter-dtype base (FSDP-QLoRA recipes cast the adapters to the base's dtype)", REFUSED,
       engine="fsdp1", method="qlora", quant="nf4", precision="bf16", gpus=2, zero=3),
    # PEFT keeps half-precision bases' adapters in fp32 (autocast_adapter_dtype): one unit would mix two dtypes
    # (`_validate_tensors_to_flatten`, torch 2.13 `torch/distributed/fsdp/_flat_param.py:814`); not with
    # --lora-adapter-dtype base (autocast_adapter_dtype=False: the adapters in the base's dtype)
    _r("engine method precision lora_adapter_dtype fsdp1_wrap", "precision",
       lambda p: p.engine is Engine.FSDP1 and p.method is Method.LORA and p.precision.param_bytes == 2
       and p.lora_adapter_dtype.value == "fp32" and p.fsdp1_wrap.value == "layers",
       "FSDP1 flattens a decoder layer into one FlatParameter of one dtype, and PEFT keeps the adapters of a "
       "{p.precision.value} base in fp32 (FSDP1 raises 'Must flatten tensors with uniform dtype'); use "
       "--precision bf16-mixed or fp32, or --lora-adapter-dtype base", REFUSED, engine="fsdp1", method="lora",
       precision="bf16", gpus=2, zero=3),
    _r("engine method lora_modules_to_save", "lora-modules-to-save",
       lambda p: p.engine is Engine.FSDP1 and p.method is Method.LORA and bool(p.lora_modules_to_save),
       "--lora-modules-to-save under FSDP1 is not modelled (a trainable copy beside its frozen original in the "
       "root's FlatParameter); leave it empty, or use --engine torch", GAP, engine="fsdp1", method="lora",
       lora_modules_to_save="lm_head", gpus=2, zero=3),
    _r("engine offload", "engine", lambda p: p.engine is Engine.FSDP1 and p.offload is not Offload.NONE,
       "FSDP1's CPUOffload(offload_params=True) is not modelled; use --offload none, or --engine torch (FSDP2's "
       "CPUOffloadPolicy)", GAP, engine="fsdp1", offload="optimizer+params", gpus=2, zero=3),
    _r("engine optimizer", "engine", lambda p: p.engine is Engine.FSDP1 and p.optimizer not in TORCH_OPTIMIZERS,
       "{p.optimizer.value} on FSDP1's flat parameter shards is not modelled; use --optimizer adamw or sgd", GAP,
       engine="fsdp1", optimizer="adamw8bit", gpus=2, zero=3),
    _r("engine fsdp_shard", "fsdp-shard",
       lambda p: p.engine is Engine.FSDP1 and p.fsdp_shard is not FsdpShard.DIM0,
       "--fsdp-shard chooses FSDP2's shard dim; FSDP1 flattens each unit into one FlatParameter and shards that "
       "flat; use --fsdp-shard dim0", REFUSED, engine="fsdp1", fsdp_shard="dim1-if-short", gpus=2, zero=3),
    _r("engine loss", "engine", lambda p: p.engine is Engine.FSDP1 and p.loss is not Loss.STANDARD,
       "{p.loss.value} under FSDP1 is not modelled; use --loss standard", GAP, engine="fsdp1",
       loss="fused-linear-ce", gpus=2, zero=3),
    # --- the fine-tuning method and its quantized base -----------------------------------------------------------
    _r("method quant", "quant", lambda p: p.method is Method.QLORA and p.quant is Quant.NONE,
       "--method qlora quantizes the frozen base: choose --quant nf4, fp4 or int8", REFUSED, method="qlora",
       quant="none", precision="bf16"),
    # QLoRA under autocast (4-bit base, torch engine, DDP/ZeRO-1): docs/MODEL-QLORA-MIXED.md; under FSDP2's
    # MixedPrecisionPolicy (ZeRO-2/3, the uint8 codes left uncast): docs/MODEL-QLORA-SHARDED.md
    _r("method precision quant engine", "precision", lambda p: p.method is Method.QLORA and p.precision.is_mixed
       and (p.quant is Quant.INT8 or p.engine is not Engine.TORCH),
       "qlora with {p.precision.value} is modelled for a 4-bit base (nf4/fp4) with --engine torch (autocast on one "
       "GPU, DDP or ZeRO-1, FSDP2's MixedPrecisionPolicy on ZeRO-2/3; an 8-bit base under autocast and FSDP1's or "
       "DeepSpeed's mixed precision over a quantized base are not); use --precision {p.precision.pure}, --quant nf4 "
       "or --engine torch", GAP, method="qlora", quant="int8", precision="bf16-mixed"),
    _r("method quant", "quant", lambda p: p.method is not Method.QLORA and p.quant is not Quant.NONE,
       "--quant quantizes the frozen base of --method qlora; use --quant none or --method qlora", REFUSED,
       method="lora", quant="nf4"),
    # measured on 2 CPU ranks: FSDP2's `_init_sharded_param` makes a plain Parameter of the Int8Params, whose CB/SCB
    # Linear8bitLt reads in its forward ("'Parameter' object has no attribute 'CB'")
    _r("method quant gpus zero engine", "quant", lambda p: p.method is Method.QLORA and p.quant is Quant.INT8
       and p.gpus > 1 and p.zero >= 2 and p.engine is Engine.TORCH,
       "FSDP2 re-creates each parameter as a plain sharded Parameter, dropping the 8-bit weight's CB/SCB that "
       "bitsandbytes' Linear8bitLt reads in its forward; use --zero 0 or 1, or --quant nf4/fp4", REFUSED,
       method="qlora", quant="int8", precision="bf16", gpus=2, zero=3),
    # --- the optimizer and its implementation ---------------------------------------------------------------------
    _r("optimizer optimizer_impl", "optimizer-impl",
       lambda p: p.optimizer is Optimizer.ADAFACTOR and p.optimizer_impl is OptimizerImpl.FUSED,
       "torch's Adafactor has no fused implementation; use default (the for-loop) or foreach", REFUSED,
       optimizer="adafactor", optimizer_impl="fused"),
    _r("optimizer optimizer_impl", "optimizer-impl",
       lambda p: p.optimizer in BNB_OPTIMIZERS and p.optimizer_impl is not OptimizerImpl.DEFAULT,
       "{p.optimizer.value} runs bitsandbytes' own kernels; use --optimizer-impl default", REFUSED,
       optimizer="adamw8bit", optimizer_impl="foreach"),
    # torch 2.13: DTensor has no sharding strategy for aten._fused_sgd_ (NotImplementedError at the step)
    _r("optimizer optimizer_impl gpus tp zero", "optimizer-impl",
       lambda p: p.optimizer is Optimizer.SGD and p.optimizer_impl is OptimizerImpl.FUSED
       and (p.tp > 1 or (p.zero >= 2 and p.gpus > 1)),
       "fused SGD does not run on DTensor parameters (ZeRO-2/3, tensor parallelism): torch has no sharding rule for "
       "aten._fused_sgd_; use foreach", REFUSED, optimizer="sgd", optimizer_impl="fused", gpus=2, zero=2),
    # measured on 2 CPU ranks (gloo), full and LoRA, torch's and transformers' TP plans alike: bitsandbytes raises
    # "got mixed torch.Tensor and DTensor" (8-bit) or "no sharding strategy" (its 32-bit update of small adapters);
    # Adafactor raises on `pow_` of a `_NormPartial` DTensor, as under FSDP2 (the rule below)
    _r("optimizer tp", "optimizer", lambda p: p.optimizer not in TORCH_OPTIMIZERS and p.tp > 1, _BNB_TP, REFUSED,
       optimizer="adafactor", gpus=2, tp=2, zero=0),
    _r("optimizer zero engine", "optimizer", lambda p: p.optimizer not in TORCH_OPTIMIZERS and p.zero >= 2
       and p.engine is not Engine.DEEPSPEED,  # Adafactor: an in-place pow_ on a partial norm; bnb: Tensor + DTensor
       "{p.optimizer.value} does not run on FSDP2's DTensor parameters (ZeRO-2/3); use --zero 0 or 1, or "
       "--optimizer adamw|sgd", REFUSED, optimizer="adamw8bit", gpus=2, zero=3),
    # --- activation checkpointing ---------------------------------------------------------------------------------
    _r("ckpt_every grad_ckpt", "ckpt-every", lambda p: p.ckpt_every > 1 and p.grad_ckpt is not GradCkpt.FULL,
       "checkpointing every {p.ckpt_every}-th layer needs --grad-ckpt full; use --grad-ckpt full, or --ckpt-every 1 "
       "for no checkpointing", REFUSED, ckpt_every=2),
    _r("grad_ckpt method", "grad-ckpt", lambda p: p.grad_ckpt is GradCkpt.SELECTIVE and p.method is not Method.FULL,
       "selective checkpointing is modelled for --method full (not measured with adapters); use --grad-ckpt full",
       GAP, grad_ckpt="selective", method="lora"),
    _r("grad_ckpt tp", "grad-ckpt", lambda p: p.grad_ckpt is GradCkpt.SELECTIVE and p.tp > 1,
       "selective checkpointing is not modelled with tensor parallelism (its policy over DTensor ops, not "
       "measured); use --tp 1, or --grad-ckpt full", GAP, grad_ckpt="selective", gpus=2, tp=2, zero=0),
    _r("grad_ckpt engine", "grad-ckpt", lambda p: p.grad_ckpt is GradCkpt.SELECTIVE and p.engine is Engine.FSDP1,
       "selective checkpointing is modelled with PyTorch's own programs (not measured under FSDP1); use --engine "
       "torch, or --grad-ckpt full", GAP, grad_ckpt="selective", engine="fsdp1", gpus=2, zero=3),
    # --- offload: torchao's CPUOffloadOptimizer (one GPU), FSDP2's CPUOffloadPolicy ---------------------------------
    _r("offload gpus", "offload", lambda p: p.offload is Offload.OPTIMIZER and p.gpus > 1,
       "optimizer offload runs torchao's CPUOffloadOptimizer, which is single-GPU; on several GPUs use --offload "
       "optimizer+params with --zero 2 or 3, or --gpus 1", REFUSED, offload="optimizer", gpus=2),
    _r("offload method", "offload", lambda p: p.offload is Offload.OPTIMIZER and p.method is not Method.FULL,
       "optimizer offload is modelled for --method full (LoRA's adapter states are a few MB); use --offload none "
       "with --method lora/qlora", GAP, offload="optimizer", method="lora"),
    _r("offload optimizer", "offload",
       lambda p: p.offload is Offload.OPTIMIZER and p.optimizer not in TORCH_OPTIMIZERS,
       "optimizer offload is modelled for torch's adamw and sgd, not {p.optimizer.value} (its states are already "
       "small); use --optimizer adamw or sgd", GAP, offload="optimizer", optimizer="adafactor"),
    _r("keep_grads offload", "keep-grads", lambda p: p.keep_grads and p.offload is Offload.OPTIMIZER,
       "gradients kept between steps are not modelled with torchao's optimizer offload (it moves them to the host "
       "as they are made); use --offload none, or leave --keep-grads off", GAP, keep_grads=True, offload="optimizer"),
    # --- the optimizer step in backward (torchtune's per-parameter optimizers, stepped by post-accumulate hooks) ---
    _r("optimizer_in_backward grad_accum", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.grad_accum > 1,
       "the optimizer step in backward steps each parameter as soon as its gradient is made, so gradients cannot "
       "accumulate over micro-steps (torchtune refuses the two together); use --grad-accum 1, or leave "
       "--optimizer-in-backward off", REFUSED, optimizer_in_backward=True, grad_accum=2),
    _r("optimizer_in_backward keep_grads", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.keep_grads,
       "the optimizer step in backward frees each gradient in its hook (zero_grad(set_to_none=True)); there is no "
       "step-end zero_grad to keep them; leave --keep-grads or --optimizer-in-backward off", REFUSED,
       optimizer_in_backward=True, keep_grads=True),
    _r("optimizer_in_backward gpus tp zero", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.scheme in (Scheme.DDP, Scheme.ZERO1),
       "the optimizer step in backward does not combine with DDP's Reducer (the hook would step the gradient before "
       "its all-reduce and free it before the Reducer copies it) nor with ZeroRedundancyOptimizer (one optimizer over "
       "a partition); use --gpus 1, or leave --optimizer-in-backward off", REFUSED, optimizer_in_backward=True,
       gpus=2, zero=0),
    _r("optimizer_in_backward gpus tp zero", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.scheme not in (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1),
       "the optimizer step in backward is modelled on one GPU only so far (FSDP2 runs the hooks on its sharded "
       "gradients, TP on DTensors: not modelled yet); use --gpus 1, or leave --optimizer-in-backward off", GAP,
       optimizer_in_backward=True, gpus=2, zero=3),
    _r("optimizer_in_backward optimizer", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.optimizer in BNB_OPTIMIZERS,
       "the optimizer step in backward is modelled for torch's optimizers, not bitsandbytes' {p.optimizer.value} (one "
       "instance per parameter, each with its own quantization maps: not modelled); use --optimizer adamw, sgd or "
       "adafactor, or leave --optimizer-in-backward off", GAP, optimizer_in_backward=True, optimizer="adamw8bit"),
    _r("optimizer_in_backward offload", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.offload is not Offload.NONE,
       "the optimizer step in backward is not modelled with offload (torchao's CPUOffloadOptimizer runs its own "
       "gradient hooks and host step; FSDP2's CPU offload steps on the host); use --offload none, or leave "
       "--optimizer-in-backward off", GAP, optimizer_in_backward=True, offload="optimizer"),
    _r("optimizer_in_backward loss", "optimizer-in-backward",
       lambda p: p.optimizer_in_backward and p.loss is not Loss.STANDARD,
       "the optimizer step in backward is not modelled with {p.loss.value} (fused-linear-ce makes the lm_head "
       "gradient in the forward, chunked-ce sums it over chunks); use --loss standard, or leave "
       "--optimizer-in-backward off", GAP, optimizer_in_backward=True,
       loss="fused-linear-ce"),
    _r("offload device", "offload", lambda p: p.offload is not Offload.NONE and p.device is Device.CPU,
       "offload moves tensors from the GPU to host memory; on the cpu profile they are the same memory (the pinned "
       "host copies need an accelerator). Use --device cuda or --offload none", REFUSED, offload="optimizer",
       device="cpu"),
    # CPUOffloadPolicy is FSDP2's: nothing to apply it to below ZeRO-2; FSDP2 over TP groups with it is not modelled
    _r("offload zero", "offload", lambda p: p.offload is Offload.OPTIMIZER_PARAMS and p.zero not in (2, 3),
       _OFFLOAD_FSDP, REFUSED, offload="optimizer+params"),
    _r("offload tp", "offload", lambda p: p.offload is Offload.OPTIMIZER_PARAMS and p.tp > 1, _OFFLOAD_FSDP, GAP,
       offload="optimizer+params", gpus=4, tp=2, zero=3),
    # --- the loss: Liger-Kernel's fused linear cross-entropy, torchtune's chunked cross-entropy ------------------
    _r("loss device", "loss", lambda p: p.loss is Loss.FUSED_LINEAR_CE and p.device is Device.CPU,
       "fused-linear-ce runs Liger-Kernel's Triton kernels, which need CUDA; use --device cuda or --loss standard",
       REFUSED, loss="fused-linear-ce", device="cpu"),
    _r("loss gpus tp zero", "loss",
       lambda p: p.loss is Loss.FUSED_LINEAR_CE and p.scheme not in (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1),
       "fused-linear-ce is modelled for a single GPU, DDP and ZeRO-1 (FSDP2 and TP gather or shard the lm_head); "
       "use --zero 0/1 and --tp 1, or --loss standard", GAP, loss="fused-linear-ce", gpus=2, zero=2),
    _r("loss method", "loss", lambda p: p.loss is Loss.FUSED_LINEAR_CE and p.method is not Method.FULL,
       "fused-linear-ce is modelled with --method full only so far; use --loss standard", GAP,
       loss="fused-linear-ce", method="lora"),
    _r("loss_chunks loss", "loss-chunks", lambda p: p.loss_chunks != 8 and p.loss is not Loss.CHUNKED_CE,
       "--loss-chunks {p.loss_chunks} splits torchtune's chunked cross-entropy; use --loss chunked-ce, or leave "
       "--loss-chunks at 8", REFUSED, loss_chunks=4),
    # the loss's peak shrinks below FSDP2's QLoRA forward moments, which measure above the walk's (-6% with the
    # standard loss and a small vocabulary too): visible only once the loss no longer dominates
    _r("loss method gpus tp zero", "loss",
       lambda p: p.loss is Loss.CHUNKED_CE and p.method is Method.QLORA and p.scheme in (Scheme.ZERO2, Scheme.ZERO3),
       "chunked-ce with qlora under FSDP2 (--zero 2/3) is not modelled: the 4-bit layers' forward then peaks above "
       "the estimate; use --zero 0/1, --method lora, or --loss standard", GAP, loss="chunked-ce", method="qlora",
       quant="nf4", precision="bf16", gpus=2, zero=3),
    # --- PEFT's modules_to_save -----------------------------------------------------------------------------------
    _r("lora_modules_to_save method", "lora-modules-to-save",
       lambda p: p.lora_modules_to_save and p.method not in LORA_METHODS,
       "trainable module copies are a LoRA option (PEFT's modules_to_save); use --method lora or qlora, or leave "
       "--lora-modules-to-save empty", REFUSED, lora_modules_to_save="lm_head"),
    # FSDP2 (ZeRO-2/3): the copies are root-group parameters (llmem.components.lora_copies_fsdp), measured on the cpu
    # profile, which cannot run CPUOffloadPolicy (FSDP1 and TP x FSDP2: their own rows)
    _r("lora_modules_to_save zero engine offload", "lora-modules-to-save",
       lambda p: p.lora_modules_to_save and p.zero >= 2 and p.engine is Engine.TORCH and p.offload is not Offload.NONE,
       "trainable module copies under FSDP2 with --offload {p.offload.value} are not measured (the copies' shards, "
       "gradients and states would move to the host with the root's); use --offload none, or leave "
       "--lora-modules-to-save empty", GAP, lora_modules_to_save="lm_head", method="lora", gpus=2, zero=3,
       offload="optimizer+params"),
    # ZeroRedundancyOptimizer raises on parameters of two dtypes
    _r("lora_modules_to_save zero precision", "lora-modules-to-save",
       lambda p: p.lora_modules_to_save and p.zero == 1 and not p.precision.is_mixed and p.precision.param_bytes == 2,
       "ZeroRedundancyOptimizer takes parameters of one dtype only, and under pure {p.precision} the module copies "
       "are {p.precision} beside the fp32 adapters (it raises); use --zero 0, --precision fp32 or bf16-mixed, or "
       "leave --lora-modules-to-save empty", REFUSED, lora_modules_to_save="lm_head", method="lora", gpus=2, zero=1,
       precision="bf16"),
    # --- bitsandbytes' nested quantization ------------------------------------------------------------------------
    _r("double_quant quant", "double-quant", lambda p: p.double_quant and p.quant not in (Quant.NF4, Quant.FP4),
       "double quantization compresses the block scales of a 4-bit base; use --method qlora --quant nf4 or fp4, or "
       "leave --double-quant off", REFUSED, double_quant=True),
)
RULES = (*RULES, *RULES_FLOAT8, *LORA_TP_RULES, *LORA_HEAD_RULES, *activation_offload_rules(), *LORA_DTYPE_RULES,
         *FSDP1_WRAP_RULES, *NO_SYNC_RULES)


def first_refusal(plan, among: Iterable[str] | None = None) -> InputError | None:
    """The error of the first rule `plan` trips, or None. With `among`, only the rules that read nothing else (a
    partial plan: link repair's inputs, which other rules would read fields of)."""
    allowed = None if among is None else set(among)
    for rule in RULES:
        if (allowed is None or set(rule.fields) <= allowed) and rule.when(plan):
            return rule.error(plan)
    return None


def check(plan) -> None:
    """Raise the error of the first rule the plan trips (`TrainingPlan.__post_init__`)."""
    error = first_refusal(plan)
    if error is not None:
        raise error


def counts() -> dict[str, int]:
    """How many rows are right refusals and how many gaps."""
    return {kind: sum(1 for r in RULES if r.kind == kind) for kind in (REFUSED, GAP)}
