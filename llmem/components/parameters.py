"""Parameters resident on one rank.

bytes = local_params * param_bytes; param_bytes = 4 for fp32 and the mixed precisions (fp32 master weights),
2 for pure bf16/fp16. Sharding per scheme: `llmem.components.sharding` (FSDP2 pads each tensor's dim 0).
LoRA: the frozen base as above plus the fp32 adapters (`llmem.components.lora`).
QLoRA: the quantized frozen base (`llmem.components.quant`) plus the fp32 adapters; under FSDP2 the packed codes
and the adapters sharded, the quant_states whole (`quant.fsdp_base_parameter_bytes`).
"""

from llmem.components import lora, quant
from llmem.components.sharding import FSDP_SCHEMES, local_params
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec


@per_spec("layout_key")
def parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if quant.is_qlora(plan) and plan.scheme in FSDP_SCHEMES:  # sharded packed codes, whole quant_states
        return quant.fsdp_base_parameter_bytes(spec, plan) + sum(lora.sharded_layer_adapter_bytes(spec, plan)) \
            + lora.sharded_outer_adapter_bytes(spec, plan)
    if quant.is_qlora(plan):  # the 4-bit Linears and the rest in the plan's dtype, whole on every rank
        return quant.base_parameter_bytes(spec, plan) + lora.adapter_bytes(spec, plan)
    base = local_params(spec, plan) * plan.precision.param_bytes
    if lora.is_lora(plan) and plan.scheme in FSDP_SCHEMES:  # FSDP2 shards the adapters with their layer
        return base + sum(lora.sharded_layer_adapter_bytes(spec, plan)) + lora.sharded_outer_adapter_bytes(spec, plan)
    return base + (lora.adapter_bytes(spec, plan) if lora.is_lora(plan) else 0)
