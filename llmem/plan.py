"""How a model is trained: the `TrainingPlan` (DESIGN.md sections 2 and 3).

Its fields, their defaults and each field's own check come from the options table (`llmem.options.PLAN_OPTIONS`);
the checks across fields are the support matrix's (`llmem.support.RULES`: each refused combination, its message and
whether it is a right refusal or a gap). A plan says nothing about the model; `validate_plan_for_model` checks the
parts that depend on it (tensor-parallel degree against the head counts, the family's traits).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, make_dataclass, replace
from enum import Enum
from functools import cached_property

from llmem import support
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
_PlanFields = make_dataclass("_PlanFields", [(o.name, o.kind, o.default) for o in PLAN_OPTIONS], frozen=True)


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
        support.check(self)  # the combinations refused, and why: one table (`llmem.support.RULES`)

    def checkpointed(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) runs under activation checkpointing: with `--grad-ckpt full`
        the layers with index % ckpt_every == 0 (transformers' `every_n_layers`), none otherwise."""
        return self.grad_ckpt is GradCkpt.FULL and layer % self.ckpt_every == 0

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

