"""How a model is trained: the `TrainingPlan` (DESIGN.md sections 2 and 3).

Its fields, their defaults and each field's own check come from the options table (`llmem.options.PLAN_OPTIONS`);
the checks across fields are the support matrix's (`llmem.support.RULES`: each refused combination, its message and
whether it is a right refusal or a gap). A plan says nothing about the model; `validate_plan_for_model` checks the
parts that depend on it (tensor-parallel degree against the head counts, the family's traits).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, fields, make_dataclass, replace
from enum import Enum
from functools import cached_property

from llmem import support
from llmem.choices import (  # re-exported: the plan's enums have always been imported from here
    FSDP1_LABELS,
    SCHEME_LABELS,
    AllocConf,
    Attention,
    Choice,
    Device,
    Engine,
    Fsdp1Wrap,
    FsdpShard,
    GradCkpt,
    LoraAdapterDtype,
    Loss,
    Method,
    Offload,
    Optimizer,
    OptimizerImpl,
    PpSchedule,
    Precision,
    Quant,
    Scheme,
)
from llmem.errors import InputError
from llmem.memo import remembered
from llmem.options import ALL_LINEAR, MAX_TOKENS, PLAN_OPTIONS, parse_lora_targets, parse_modules_to_save

__all__ = ["ALL_LINEAR", "FSDP1_LABELS", "MAX_GPUS", "MAX_TOKENS", "SCHEME_LABELS", "AllocConf", "Attention", "Choice",
           "Device", "Engine", "Fsdp1Wrap", "FsdpShard", "GradCkpt", "LoraAdapterDtype",
           "Loss", "Method", "Offload", "Optimizer", "OptimizerImpl",
           "PpSchedule", "Precision", "Quant", "Scheme", "TrainingPlan", "parse_lora_targets", "parse_modules_to_save"]

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
    return remembered(_INTERNED, values, lambda: next(_SERIALS))


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
        the layers with index % ckpt_every == 0 (transformers' `every_n_layers`), with `selective` every layer, none
        otherwise."""
        if self.grad_ckpt is GradCkpt.SELECTIVE:
            return True
        return self.grad_ckpt is GradCkpt.FULL and layer % self.ckpt_every == 0

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
        if self.pp > 1:
            return Scheme.PP
        if self.tp > 1:
            return Scheme.TP if self.gpus == self.tp else Scheme.TP_ZERO3
        if self.gpus == 1:
            return Scheme.SINGLE
        return (Scheme.DDP, Scheme.ZERO1, Scheme.ZERO2, Scheme.ZERO3)[self.zero]

    @property
    def strategy_label(self) -> str:
        """The scheme's label, naming FSDP1 and its sharding strategy under `--engine fsdp1`, and DeepSpeed."""
        if self.engine is Engine.FSDP1 and self.scheme in FSDP1_LABELS:
            return FSDP1_LABELS[self.scheme]
        if self.engine is Engine.DEEPSPEED:
            return f"ZeRO-{self.zero} (DeepSpeed)"
        return self.scheme.label

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different data."""
        return self.gpus // (self.tp * self.pp)

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
        return self.batch_size * self.seq_len * self.dp // self.cp  # --cp: a group of cp ranks shares a sequence

    def with_(self, **changes) -> TrainingPlan:
        """The plan with `changes`. A derived plan of one GPU or one micro-step (a walk's compute plan) drops
        `--no-sync`, which there synchronizes nothing (the refusal is for plans given so)."""
        if self.no_sync and "no_sync" not in changes and (changes.get("gpus", 2) == 1
                                                          or changes.get("grad_accum", 2) == 1):
            changes["no_sync"] = False
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Enum) else v) for f in fields(self)}

