"""Parameters resident on one rank.

bytes = local_params * param_bytes; param_bytes = 4 for fp32 and the mixed precisions (fp32 master weights),
2 for pure bf16/fp16. Sharding per scheme: `llmem.components.sharding` (FSDP2 pads each tensor's dim 0).
LoRA: the frozen base as above plus the fp32 adapters (`llmem.components.lora`).
QLoRA: the quantized frozen base (`llmem.components.quant`) plus the fp32 adapters; under FSDP2 the packed codes
and the adapters sharded, the quant_states whole (`quant.fsdp_base_parameter_bytes`).
A traced architecture's buffers (`llmem.derive.buffers`: GPT-Neo's causal masks, GPT-J's sinusoidal tables) are
counted with them, whole on every rank (FSDP2 and TP leave buffers unsharded); the hand-written families' are a few
hundred bytes of RoPE inv_freq, not counted.
"""

from llmem.components.trainable import trainable
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec


@per_spec("layout_key")
def parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The base (QLoRA: its quantized Linears) and the adapters beside it (`trainable.Trainable`); a traced
    architecture's buffers."""
    t = trainable(spec, plan)
    buffers = spec.derived.buffer_bytes(plan) if spec.derived is not None else 0
    return t.base + t.adapters + buffers
