"""The enums of a plan (DESIGN.md sections 2 and 3): each value is its command-line spelling."""

from __future__ import annotations

from enum import Enum

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
    def pure(self) -> Precision:
        """The pure dtype a mixed precision computes in (bf16-mixed -> bf16): what a QLoRA base is built in."""
        return {Precision.BF16_MIXED: Precision.BF16, Precision.FP16_MIXED: Precision.FP16}.get(self, self)

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
    SELECTIVE = "selective"  # op-level selective checkpointing with torchtitan's save policy (runtime/selective.py)


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
    CHUNKED_CE = "chunked-ce"  # torchtune's CEWithChunkedOutputLoss: the lm_head and the loss per chunk of tokens


class PpSchedule(Choice):
    """`--pp-schedule`: torch.distributed.pipelining's schedules (`get_schedule_class` names, lower case)."""

    GPIPE = "gpipe"  # ScheduleGPipe: every microbatch's forward, then every backward
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: pp - stage forwards in flight, then one backward per forward
    INTERLEAVED_1F1B = "interleaved-1f1b"  # ScheduleInterleaved1F1B: --pp-stages-per-rank stages on each rank


class AllocConf(Choice):
    """`PYTORCH_CUDA_ALLOC_CONF` of the program: the caching allocator's segments (DESIGN.md "Project extensions")."""

    DEFAULT = "default"  # fixed-size segments (c10/cuda/CUDACachingAllocator.cpp)
    EXPANDABLE = "expandable-segments"  # expandable_segments:True: one growing segment per pool and stream


class Scheme(Choice):
    """What runs, derived from (gpus, tp, zero) exactly as DESIGN.md section 2 fixes it."""

    SINGLE = "single"
    DDP = "ddp"
    ZERO1 = "zero1"  # DDP + ZeroRedundancyOptimizer
    ZERO2 = "zero2"  # FSDP2, reshard_after_forward=False
    ZERO3 = "zero3"  # FSDP2, reshard_after_forward=True
    TP = "tp"
    TP_ZERO3 = "tp+zero3"  # 2-D mesh: TP inside, FSDP2 across
    PP = "pp"  # pipeline parallel: one stage per GPU (torch.distributed.pipelining)

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
    Scheme.PP: "pipeline parallel",
}


FSDP1_LABELS = {Scheme.DDP: "ZeRO-0 (FSDP1 NO_SHARD)", Scheme.ZERO2: "ZeRO-2 (FSDP1 SHARD_GRAD_OP)",
                Scheme.ZERO3: "ZeRO-3 (FSDP1 FULL_SHARD)", Scheme.SINGLE: "one GPU (FSDP1 NO_SHARD, a world of one)"}


class Engine(Choice):
    """The training engine whose program is estimated (`--engine`): PyTorch's own programs (torch), or PyTorch's
    FullyShardedDataParallel (FSDP1) as accelerate and the HF Trainer configure it (fsdp1), or DeepSpeed's engine with
    ZeRO-0/1/2 (deepspeed; ZeRO-3 a gap)."""

    TORCH = "torch"
    FSDP1 = "fsdp1"
    DEEPSPEED = "deepspeed"


class Float8(Choice):
    """`--float8`: torchao's float8 training (`convert_to_float8_training`, torchao 0.18) of the decoder layers'
    Linears, with the `Float8LinearConfig.from_recipe_name` recipe (torchao/float8/config.py)."""

    NONE = "none"
    TENSORWISE = "tensorwise"  # one fp32 scale per cast tensor (dynamic scaling)
    ROWWISE = "rowwise"  # one fp32 scale per row of each cast operand (axiswise dynamic scaling)


class LoraAdapterDtype(Choice):
    """`--lora-adapter-dtype`: the dtype PEFT leaves the LoRA adapters in (peft 0.21.2). fp32: `get_peft_model`'s
    default `autocast_adapter_dtype=True` upcasts bf16/fp16 adapters to fp32 (`tuners/tuners_utils.py:2719-2745`).
    base: `autocast_adapter_dtype=False` leaves them in the base layer's dtype, to which `update_layer` moves them
    (`tuners/lora/layer.py:314`, `_move_adapter_to_device_of_base_layer`, `tuners/tuners_utils.py:2183-2186`), as
    torchtune, Answer.AI's FSDP-QLoRA train.py and LitGPT's bf16-true keep them."""

    FP32 = "fp32"
    BASE = "base"


class Fsdp1Wrap(Choice):
    """`--fsdp1-wrap`: FSDP1's auto wrap policy under LoRA. layers: accelerate's `transformer_auto_wrap_policy`
    (adapters inside the layer's unit, use_orig_params=True). adapters: the FSDP-LoRA recipes' `_or_policy` of a
    lambda policy (a leaf module whose `weight.requires_grad`: each lora_A / lora_B Linear) and the transformer policy,
    use_orig_params=False (Answer.AI fsdp_qlora train.py `get_wrapping_policy`, PEFT 0.21.2 `utils/other.py`
    `fsdp_auto_wrap_policy`, torchtune `lora_fsdp_wrap_policy`)."""

    LAYERS = "layers"
    ADAPTERS = "adapters"
