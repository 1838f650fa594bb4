"""How a model is trained: the `TrainingPlan` and its enums (DESIGN.md sections 2 and 3).

A plan says nothing about the model; `validate_plan_for_model` checks the parts that depend on it
(tensor-parallel degree against the head counts, supported families).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum
from functools import cached_property

from llmem.errors import InputError


class Choice(str, Enum):
    """An enum whose values are the command-line spellings."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, field: str, value: object) -> Choice:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise InputError(field, f"{value!r} is not one of: {allowed}") from None


class Precision(Choice):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"

    @property
    def param_bytes(self) -> int:
        """Bytes per element of parameters, gradients and optimizer states."""
        return 2 if self in (Precision.BF16, Precision.FP16) else 4

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations (autocast computes in the half dtype)."""
        return 4 if self is Precision.FP32 else 2

    @property
    def is_mixed(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def torch_dtype_name(self) -> str:
        """Name of the dtype parameters are stored in (`torch.<name>`)."""
        return {Precision.BF16: "bfloat16", Precision.FP16: "float16"}.get(self, "float32")

    @property
    def compute_dtype_name(self) -> str:
        return {
            Precision.BF16: "bfloat16",
            Precision.FP16: "float16",
            Precision.BF16_MIXED: "bfloat16",
            Precision.FP16_MIXED: "float16",
        }.get(self, "float32")


class Optimizer(Choice):
    ADAMW = "adamw"
    SGD = "sgd"
    ADAFACTOR = "adafactor"  # torch.optim.Adafactor: factored second moment, no first moment
    ADAMW8BIT = "adamw8bit"  # bitsandbytes AdamW8bit: blockwise-quantized uint8 states
    PAGED_ADAMW8BIT = "paged-adamw8bit"  # bitsandbytes PagedAdamW8bit: the same states in CUDA unified memory


class OptimizerImpl(Choice):
    DEFAULT = "default"  # what torch picks for the device: foreach on CUDA, for-loop on CPU
    FOREACH = "foreach"
    FUSED = "fused"
    FORLOOP = "forloop"


class GradCkpt(Choice):
    NONE = "none"
    FULL = "full"


class Attention(Choice):
    SDPA = "sdpa"
    EAGER = "eager"


class Device(Choice):
    CUDA = "cuda"
    CPU = "cpu"


class Method(Choice):
    """Fine-tuning method (DESIGN.md section 3 reserved names; "Project extensions" for what runs)."""

    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"  # LoRA over a bitsandbytes-quantized frozen base (`--quant`)


class Quant(Choice):
    """Storage of the frozen base's decoder-layer Linear weights under `--method qlora` (bitsandbytes)."""

    NONE = "none"
    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"  # LLM.int8: bnb.nn.Linear8bitLt, int8 weight + fp32 row scales


class Offload(Choice):
    """What leaves the GPU for host memory (DESIGN.md "Project extensions"): the optimizer (torchao's
    CPUOffloadOptimizer, one GPU), or FSDP2's sharded parameters, gradients and optimizer states."""

    NONE = "none"
    OPTIMIZER = "optimizer"  # torchao CPUOffloadOptimizer: states (and gradients) on the host, one GPU
    OPTIMIZER_PARAMS = "optimizer+params"  # FSDP2 CPUOffloadPolicy()


class FsdpShard(Choice):
    """Which dim FSDP2 shards each tensor on (`fully_shard(shard_placement_fn=...)`, torch 2.13). dim0: FSDP2's
    default, dim 0 padded to a multiple of the ranks. dim1-if-short: `Shard(1)` for a tensor whose dim 0 has fewer
    rows than data-parallel ranks and whose dim 1 divides evenly by them (FSDP2 allows uneven sharding on dim 0
    only): MoE's stacked experts past num_experts GPUs. No effect outside FSDP2 (--zero 2/3)."""

    DIM0 = "dim0"
    DIM1_IF_SHORT = "dim1-if-short"


class Loss(Choice):
    """How the causal-LM loss is computed (DESIGN.md "Project extensions")."""

    STANDARD = "standard"  # transformers' ForCausalLMLoss on materialized logits
    FUSED_LINEAR_CE = "fused-linear-ce"  # Liger-Kernel's fused linear cross-entropy (no logits materialized)


class Scheme(Choice):
    """What runs, derived from (gpus, tp, zero) exactly as DESIGN.md section 2 fixes it."""

    SINGLE = "single"
    DDP = "ddp"
    ZERO1 = "zero1"  # DDP + ZeroRedundancyOptimizer
    ZERO2 = "zero2"  # FSDP2, reshard_after_forward=False
    ZERO3 = "zero3"  # FSDP2, reshard_after_forward=True
    TP = "tp"
    TP_ZERO3 = "tp+zero3"  # 2-D mesh: TP inside, FSDP2 across

    @property
    def label(self) -> str:
        return SCHEME_LABELS[self]


SCHEME_LABELS = {
    Scheme.SINGLE: "single GPU",
    Scheme.DDP: "DDP",
    Scheme.ZERO1: "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
    Scheme.ZERO2: "ZeRO-2 (FSDP2, no reshard after forward)",
    Scheme.ZERO3: "ZeRO-3 (FSDP2, reshard after forward)",
    Scheme.TP: "tensor parallel",
    Scheme.TP_ZERO3: "TP × FSDP2 (ZeRO-3)",
}

MAX_GPUS = 65536
MAX_TOKENS = 1 << 24


@dataclass(frozen=True)
class TrainingPlan:
    """How one training step runs. Defaults follow DESIGN.md's command line."""

    gpus: int = 1
    tp: int = 1
    zero: int = 0
    batch_size: int = 1
    seq_len: int = 2048
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.DEFAULT
    grad_ckpt: GradCkpt = GradCkpt.NONE
    attn: Attention = Attention.SDPA
    device: Device = Device.CUDA
    method: Method = Method.FULL
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_targets: str = "all-linear"
    grad_accum: int = 1
    quant: Quant = Quant.NONE
    ckpt_every: int = 1
    offload: Offload = Offload.NONE
    loss: Loss = Loss.STANDARD
    lora_modules_to_save: str = ""
    double_quant: bool = False
    fsdp_shard: FsdpShard = FsdpShard.DIM0

    def __post_init__(self) -> None:
        for name, enum in _ENUM_FIELDS.items():
            object.__setattr__(self, name, enum.parse(name.replace("_", "-"), getattr(self, name)))
        for name in ("gpus", "tp", "batch_size", "seq_len", "lora_rank", "lora_alpha", "grad_accum", "ckpt_every"):
            value = _as_int(name, getattr(self, name))
            object.__setattr__(self, name, value)
            if value < 1:
                raise InputError(_flag(name), f"must be a positive whole number, got {value}")
        object.__setattr__(self, "zero", _as_int("zero", self.zero))
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
        object.__setattr__(self, "double_quant", _as_bool("double-quant", self.double_quant))
        if self.double_quant and self.quant not in (Quant.NF4, Quant.FP4):
            raise InputError("double-quant", "double quantization compresses the block scales of a 4-bit base; use "
                             "--method qlora --quant nf4 or fp4, or leave --double-quant off")

    def _validate_modules_to_save(self) -> None:
        """PEFT's `modules_to_save`: trainable copies of whole modules beside the LoRA adapters (which names a model
        accepts is checked against the model: `llmem.components.lora.validate`)."""
        object.__setattr__(self, "lora_modules_to_save", parse_modules_to_save(self.lora_modules_to_save))
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
        object.__setattr__(self, "lora_dropout", _as_probability("lora-dropout", self.lora_dropout))
        object.__setattr__(self, "lora_targets", parse_lora_targets(self.lora_targets))
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
        if self.optimizer in (Optimizer.ADAMW, Optimizer.SGD):
            return
        if self.tp > 1:
            raise InputError("optimizer", f"{name} is not modelled with tensor parallelism; use --tp 1, or "
                             "--optimizer adamw|sgd")
        if self.zero >= 2:
            raise InputError("optimizer", f"{name} does not run on FSDP2's DTensor parameters (ZeRO-2/3); use "
                             "--zero 0 or 1, or --optimizer adamw|sgd")

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


_ENUM_FIELDS = {
    "fsdp_shard": FsdpShard,
    "precision": Precision,
    "optimizer": Optimizer,
    "optimizer_impl": OptimizerImpl,
    "grad_ckpt": GradCkpt,
    "attn": Attention,
    "device": Device,
    "method": Method,
    "quant": Quant,
    "offload": Offload,
    "loss": Loss,
}

ALL_LINEAR = "all-linear"


def _as_bool(field: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", ""):
        return False
    raise InputError(field, f"expected true or false, got {str(value)[:40]!r}")


def parse_lora_targets(value: object) -> str:
    """`all-linear` (every Linear but the output layer, as PEFT resolves it) or a comma-separated list of PEFT
    module names (a module is targeted when its name equals one or ends with "." + one). Normalised spelling."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise InputError("lora-targets", f"expected all-linear or a comma-separated list of names, got {value!r}")
    text = value.strip()
    if text.lower() == ALL_LINEAR:
        return ALL_LINEAR
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InputError("lora-targets", "give all-linear or module names such as q_proj,v_proj")
    for n in names:
        if not all(part.isidentifier() or part.isdigit() for part in n.split(".")):
            raise InputError("lora-targets", f"{n!r} is not a module name (letters, digits, _ and .)")
    return ",".join(dict.fromkeys(names))


def parse_modules_to_save(value: object) -> str:
    """A comma-separated list of module names as PEFT's `modules_to_save` takes them (a module is wrapped when its
    full name ends with the name), e.g. `lm_head,embed_tokens`; empty = none. Normalised spelling."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise InputError("lora-modules-to-save", f"expected comma-separated module names, got {value!r}")
    names = [n.strip() for n in value.split(",") if n.strip()]
    for n in names:
        if not all(part.isidentifier() or part.isdigit() for part in n.split(".")):
            raise InputError("lora-modules-to-save", f"{n!r} is not a module name (letters, digits, _ and .); "
                             "give names such as lm_head,embed_tokens")
    return ",".join(dict.fromkeys(names))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _as_probability(name: str, value: object) -> float:
    try:
        p = float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(name, f"must be a number in [0, 1), got {value!r}") from None
    if isinstance(value, bool) or not 0.0 <= p < 1.0:
        raise InputError(name, f"must be a number in [0, 1), got {value!r}")
    return p


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise InputError(_flag(name), f"must be a whole number, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InputError(_flag(name), f"must be a whole number, got {value!r}")
