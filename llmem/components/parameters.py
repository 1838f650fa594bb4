"""Parameters resident on one rank.

bytes = local_params * param_bytes; param_bytes = 4 for fp32 and the mixed precisions (fp32 master weights),
2 for pure bf16/fp16. Sharding per scheme: `llmem.components.sharding` (FSDP2 pads each tensor's dim 0).
LoRA: the frozen base as above plus the fp32 adapters (`llmem.components.lora`).
QLoRA: the quantized frozen base (`llmem.components.quant`) plus the fp32 adapters; under FSDP2 the packed codes
and the adapters sharded, the quant_states whole (`quant.fsdp_base_parameter_bytes`).
A traced architecture's buffers (`llmem.derive.buffers`: GPT-Neo's causal masks, GPT-J's sinusoidal tables) are
counted with them, whole on every rank (FSDP2 and TP leave buffers unsharded); so are a hand-written family's
(`llmem.components.buffers`: RoPE's inv_freq and original_inv_freq, Gemma's embed_scale).
"""

from llmem.components import buffers as hand_written
from llmem.components.trainable import trainable
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec


@per_spec("layout_key")
def parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The base (QLoRA: its quantized Linears) and the adapters beside it (`trainable.Trainable`); a traced
    architecture's buffers or a hand-written family's."""
    t = trainable(spec, plan)
    return t.base + t.adapters + buffer_bytes(spec, plan)


def buffer_bytes(spec: ModelSpec, plan: TrainingPlan, cast_bytes: int | None = None) -> int:
    """The model's buffers, whole on the device; with FSDP2's CPU offload too: `fully_shard` moves them to the
    device with the parameters (`_move_states_to_device`, torch 2.13 `_fully_shard/_fsdp_init.py:369-401`) and only
    the sharded parameters go to the host. `cast_bytes`: a hand-written family's after FSDP1's buffer cast (a traced
    architecture's are counted as built, at most that)."""
    if spec.derived is not None:
        return spec.derived.buffer_bytes(plan)
    return hand_written.buffer_bytes(spec, plan, cast_bytes)
