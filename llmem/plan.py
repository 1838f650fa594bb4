"""How a model is trained: the `TrainingPlan` (DESIGN.md sections 2 and 3).

Its fields, their defaults and each field's own check come from the options table (`llmem.options.PLAN_OPTIONS`);
the checks across fields are here. A plan says nothing about the model; `validate_plan_for_model` checks the parts
that depend on it (tensor-parallel degree against the head counts, supported families).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, fields, make_dataclass, replace
from enum import Enum
from functools import cached_property

from llmem.choices import (  # re-exported: the plan's enums have always been imported from here
    SCHEME_LABELS,
    Attention,
    Choice,
    Device,
    Engine,
    FsdpShard,
    GradCkpt,
    Loss,
    Method,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    Scheme,
)
from llmem.errors import InputError
from llmem.options import ALL_LINEAR, MAX_TOKENS, PLAN_OPTIONS, parse_lora_targets, parse_modules_to_save

__all__ = ["ALL_LINEAR", "MAX_GPUS", "MAX_TOKENS", "SCHEME_LABELS", "Attention", "Choice", "Device", "Engine",
           "FsdpShard", "GradCkpt", "Loss", "Method", "Offload", "Optimizer", "OptimizerImpl", "Precision", "Quant",
           "Scheme", "TrainingPlan", "parse_lora_targets", "parse_modules_to_save"]

MAX_GPUS = 65536

_COERCERS = tuple((o.name, o.coercer) for o in PLAN_OPTIONS)
_NAMES = tuple(o.name for o in PLAN_OPTIONS)
_TOKEN_FIELDS = ("batch_size", "seq_len")  # what the terms over parameters never read
_CACHED = ("key", "layout_key", "_values", "_hash")
_VALUES = operator.attrgetter(*_NAMES)
_LAYOUT_VALUES = operator.attrgetter(*(n for n in _NAMES if n not in _TOKEN_FIELDS))
_PlanFields = make_dataclass("_PlanFields", [(o.name, o.kind, o.default) for o in PLAN_OPTIONS], frozen=True)


_INTERNED: dict = {}  # field values -> their serial number
_SERIALS = itertools.count()


def field_key(values: tuple) -> int:
    """A serial number for `values`, the same for equal values: per-spec caches look terms up by it (an int hashes
    and compares at once; hashing the plan hashes every field again). At most 4,096 are kept; past that, values
    seen again get a new number (a cache miss, never a wrong hit: numbers are not reused)."""
    key = _INTERNED.get(values)
    if key is None:
        if len(_INTERNED) >= 4096:
            _INTERNED.clear()
        key = _INTERNED[values] = next(_SERIALS)
    return key


@dataclass(frozen=True)
class TrainingPlan(_PlanFields):
    """How one training step runs: one field per row of `llmem.options.PLAN_OPTIONS` (gpus, tp, zero, batch_size,
    seq_len, precision, optimizer, ...), with the defaults of DESIGN.md's command line."""

    def __post_init__(self) -> None:
        for name, coerce in _COERCERS:
            value = getattr(self, name)
            if (coerced := coerce(value)) is not value:
                object.__setattr__(self, name, coerced)
        if self.gpus > MAX_GPUS:
            raise InputError("gpus", f"at most {MAX_GPUS} GPUs are supported, got {self.gpus}")
        if self.batch_size * self.seq_len > MAX_TOKENS:
            raise InputError("batch-size", f"batch-size × seq-len must stay under {MAX_TOKENS:,} tokens per GPU")
        if self.zero not in (0, 1, 2, 3):
            raise InputError("zero", f"must be 0, 1, 2 or 3, got {self.zero}")
        if self.gpus % self.tp:
            raise InputError("tp", f"TP degree {self.tp} must divide the GPU count {self.gpus}")
        if self.gpus == 1 and self.zero:
            raise InputError("zero", "ZeRO shards across GPUs; with --gpus 1 use --zero 0")
        if self.tp > 1 and self.gpus == self.tp and self.zero:
            raise InputError("zero", f"with --tp {self.tp} on {self.gpus} GPUs there is no data-parallel "
                             "group to shard over; use --zero 0, or more GPUs with --zero 3")
        if self.tp > 1 and self.gpus > self.tp and self.zero != 3:
            raise InputError("zero", "TP combined with data parallelism runs FSDP2 across the TP groups; "
                             "use --zero 3")
        self._validate_method()
        self._validate_ckpt_every()
        self._validate_offload()
        self._validate_loss()
        self._validate_modules_to_save()
        self._validate_double_quant()

    def _validate_double_quant(self) -> None:
        """`--double-quant`: bitsandbytes' nested quantization of a 4-bit base's block scales
        (`bnb_4bit_use_double_quant`)."""
        if self.double_quant and self.quant not in (Quant.NF4, Quant.FP4):
            raise InputError("double-quant", "double quantization compresses the block scales of a 4-bit base; use "
                             "--method qlora --quant nf4 or fp4, or leave --double-quant off")

    def _validate_modules_to_save(self) -> None:
        """PEFT's `modules_to_save`: trainable copies of whole modules beside the LoRA adapters (which names a model
        accepts is checked against the model: `llmem.components.lora.validate`)."""
        if not self.lora_modules_to_save:
            return
        if self.method not in (Method.LORA, Method.QLORA):
            raise InputError("lora-modules-to-save", "trainable module copies are a LoRA option (PEFT's "
                             "modules_to_save); use --method lora or qlora, or leave --lora-modules-to-save empty")
        if self.zero >= 2:
            raise InputError("lora-modules-to-save", "trainable module copies under FSDP2 (--zero 2/3) are not "
                             "modelled: the root group would all-gather and reduce-scatter the copied embedding / "
                             "lm_head beside the frozen originals; use --zero 0 or 1, or leave "
                             "--lora-modules-to-save empty")
        if self.zero == 1 and not self.precision.is_mixed and self.precision.param_bytes == 2:
            raise InputError("lora-modules-to-save", "ZeroRedundancyOptimizer takes parameters of one dtype only, "
                             f"and under pure {self.precision} the module copies are {self.precision} beside the "
                             "fp32 adapters (it raises); use --zero 0, --precision fp32 or bf16-mixed, or leave "
                             "--lora-modules-to-save empty")

    def _validate_ckpt_every(self) -> None:
        """`--ckpt-every K` selects which layers `--grad-ckpt full` checkpoints; it has no meaning without it."""
        if self.ckpt_every > 1 and self.grad_ckpt is not GradCkpt.FULL:
            raise InputError("ckpt-every", f"checkpointing every {self.ckpt_every}-th layer needs --grad-ckpt full; "
                             "use --grad-ckpt full, or --ckpt-every 1 for no checkpointing")

    def checkpointed(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) runs under activation checkpointing: with `--grad-ckpt full`
        the layers with index % ckpt_every == 0 (transformers' `every_n_layers`), none otherwise."""
        return self.grad_ckpt is GradCkpt.FULL and layer % self.ckpt_every == 0

    def _validate_offload(self) -> None:
        if self.offload is Offload.NONE:
            return
        if self.offload is Offload.OPTIMIZER:
            self._validate_optimizer_offload()
        if self.device is Device.CPU:
            raise InputError("offload", "offload moves tensors from the GPU to host memory; on the cpu profile they "
                             "are the same memory (the pinned host copies need an accelerator). Use --device "
                             "cuda or --offload none")
        if self.offload is Offload.OPTIMIZER:
            return
        if self.tp > 1 or self.zero not in (2, 3):
            raise InputError("offload", "optimizer+params runs FSDP2's CPUOffloadPolicy, modelled for --zero 2 or 3 "
                             "with --tp 1 on 2 or more GPUs; use that, or --offload none")

    def _validate_optimizer_offload(self) -> None:
        """`--offload optimizer` is torchao's `CPUOffloadOptimizer`: a single-GPU optimizer wrapper (its gradient
        hooks copy un-reduced gradients, so it does not compose with DDP or FSDP2), over torch's own optimizers."""
        if self.gpus > 1:
            raise InputError("offload", "optimizer offload runs torchao's CPUOffloadOptimizer, which is single-GPU; "
                             "on several GPUs use --offload optimizer+params with --zero 2 or 3, or --gpus 1")
        if self.method is not Method.FULL:
            raise InputError("offload", "optimizer offload is modelled for --method full (LoRA's adapter states "
                             "are a few MB); use --offload none with --method lora/qlora")
        if self.optimizer not in (Optimizer.ADAMW, Optimizer.SGD):
            raise InputError("offload", f"optimizer offload is modelled for torch's adamw and sgd, not "
                             f"{self.optimizer.value} (its states are already small); use --optimizer adamw or sgd")

    def _validate_loss(self) -> None:
        if self.loss is Loss.STANDARD:
            return
        if self.device is Device.CPU:
            raise InputError("loss", "fused-linear-ce runs Liger-Kernel's Triton kernels, which need CUDA; use "
                             "--device cuda or --loss standard")
        if self.scheme not in (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1):
            raise InputError("loss", "fused-linear-ce is modelled for a single GPU, DDP and ZeRO-1 (FSDP2 and TP "
                             "gather or shard the lm_head); use --zero 0/1 and --tp 1, or --loss standard")
        if self.method is not Method.FULL:
            raise InputError("loss", "fused-linear-ce is modelled with --method full only so far; use --loss standard")

    def _validate_method(self) -> None:
        if self.method is Method.QLORA:
            if self.quant is Quant.NONE:
                raise InputError("quant", "--method qlora quantizes the frozen base: choose --quant nf4, fp4 or int8")
            if self.quant is Quant.INT8 and self.ckpt_every > 1:
                raise InputError("ckpt-every", "partial checkpointing is not modelled with an int8 base (its Linears "
                                 "keep their inputs until the step ends, checkpointed or not); use --ckpt-every 1")
            if self.precision.is_mixed:
                raise InputError("precision", "qlora is modelled with the base built in its compute dtype (pure "
                                 "bf16, fp16 or fp32, as QLoRA recipes load it); use --precision bf16")
        elif self.quant is not Quant.NONE:
            raise InputError("quant", "--quant quantizes the frozen base of --method qlora; use --quant none "
                             "or --method qlora")
        if self.method is not Method.FULL and self.tp > 1:
            raise InputError("tp", f"{self.method} with tensor parallelism is not supported: PEFT replaces q_proj, "
                             "v_proj, ... by LoRA layers, so the Megatron TP plan's module names no longer match (and "
                             "a quantized base split by TP is not modelled); use --tp 1 (DDP, ZeRO-1, FSDP2 ZeRO-2/3) "
                             "or --method full")
        if self.method is Method.QLORA and self.quant is Quant.INT8 and self.gpus > 1:
            raise InputError("quant", "the 8-bit (int8) base is modelled and measured on one GPU only; use --gpus 1, "
                             "or --quant nf4/fp4 for DDP/ZeRO-1")
        self._validate_optimizer()

    def _validate_optimizer(self) -> None:
        """The memory-saving optimizers run on one GPU, DDP and ZeRO-1 (plain tensors). Under FSDP2 they fail on
        DTensor parameters (Adafactor: an in-place pow_ on a partial norm; bitsandbytes: mixed Tensor and DTensor);
        tensor parallelism is not measured with them."""
        name = self.optimizer.value
        if self.optimizer is Optimizer.ADAFACTOR and self.optimizer_impl is OptimizerImpl.FUSED:
            raise InputError("optimizer-impl", "torch's Adafactor has no fused implementation; use default "
                             "(the for-loop) or foreach")
        if self.optimizer in (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT) \
                and self.optimizer_impl is not OptimizerImpl.DEFAULT:
            raise InputError("optimizer-impl", f"{name} runs bitsandbytes' own kernels; use --optimizer-impl default")
        if self.optimizer is Optimizer.SGD and self.optimizer_impl is OptimizerImpl.FUSED and \
                (self.tp > 1 or (self.zero >= 2 and self.gpus > 1)):
            # torch 2.13: DTensor has no sharding strategy for aten._fused_sgd_ (NotImplementedError at the step)
            raise InputError("optimizer-impl", "fused SGD does not run on DTensor parameters (ZeRO-2/3, tensor "
                             "parallelism): torch has no sharding rule for aten._fused_sgd_; use foreach")
        if self.optimizer in (Optimizer.ADAMW, Optimizer.SGD):
            return
        if self.tp > 1:
            raise InputError("optimizer", f"{name} is not modelled with tensor parallelism; use --tp 1, or "
                             "--optimizer adamw|sgd")
        if self.zero >= 2:
            raise InputError("optimizer", f"{name} does not run on FSDP2's DTensor parameters (ZeRO-2/3); use "
                             "--zero 0 or 1, or --optimizer adamw|sgd")

    @cached_property
    def key(self) -> int:
        """The plan's field values as one number (`field_key`): the key of per-spec caches of its terms."""
        return field_key(self._values)

    @cached_property
    def layout_key(self) -> int:
        """The fields but the micro-batch and the sequence length: the key of the terms over parameters (sharding,
        communication buffers, optimizer states), which compare's max-batch solve asks for at several batches."""
        return field_key(_LAYOUT_VALUES(self))

    @cached_property
    def _values(self) -> tuple:
        return _VALUES(self)

    @cached_property
    def _hash(self) -> int:
        return hash(self._values)

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict:
        """Pickled without what is cached: a string's hash, and a key's number, differ from one process to the next."""
        return {k: v for k, v in self.__dict__.items() if k not in _CACHED}

    @cached_property
    def scheme(self) -> Scheme:
        if self.tp > 1:
            return Scheme.TP if self.gpus == self.tp else Scheme.TP_ZERO3
        if self.gpus == 1:
            return Scheme.SINGLE
        return (Scheme.DDP, Scheme.ZERO1, Scheme.ZERO2, Scheme.ZERO3)[self.zero]

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different data."""
        return self.gpus // self.tp

    @property
    def effective_optimizer_impl(self) -> OptimizerImpl:
        """The implementation that runs: torch picks foreach on CUDA and the for-loop one on CPU (Adafactor: the
        for-loop everywhere). bitsandbytes' optimizers ignore it (their own kernels)."""
        if self.optimizer_impl is not OptimizerImpl.DEFAULT:
            return self.optimizer_impl
        if self.optimizer is Optimizer.ADAFACTOR:  # Adafactor(foreach=None) runs the for-loop on every device
            return OptimizerImpl.FORLOOP
        return OptimizerImpl.FOREACH if self.device is Device.CUDA else OptimizerImpl.FORLOOP

    @property
    def tokens_per_step(self) -> int:
        """Tokens the whole job processes per optimizer step (micro-batch × seq × data-parallel ranks)."""
        return self.batch_size * self.seq_len * self.dp

    def with_(self, **changes) -> TrainingPlan:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Enum) else v) for f in fields(self)}

