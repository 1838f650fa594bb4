"""LoRA with tensor parallelism (`--method lora --tp T`, `--gpus T`): the program users run, transformers' TP first,
PEFT after it.

What runs (transformers 5.23, peft 0.21.2):
1. `from_pretrained(..., tp_plan="auto")` shards the base at load (`PreTrainedModel.maybe_distribute_model`,
   `transformers/distributed/mixin.py:304-343`): it records `config.distributed_config`, the device mesh
   (`model._device_mesh`, dims named ("pp", "fsdp", "tp")) and `model._tp_size` (mixin.py:314-318), then applies
   the resolved plan (`apply_tensor_parallelism`, `distributed/tensor_parallel.py:639`): the config's
   `base_model_tp_plan`, `lm_head: colwise_gather_output`, `embed_tokens: embedding_rowwise` — for every model,
   llama included (the hand-written Megatron plan of full fine-tuning is not what `tp_plan="auto"` runs). Here the
   built model is sharded by the runtime's own application of that plan (`parallel.apply_hf_tp`, the tied head
   sharded once as `from_pretrained` does) and the three attributes are set as mixin.py:314-318 sets them, on a
   1-D mesh named "tp".
2. `get_peft_model(model, LoraConfig(...))`: for each targeted Linear PEFT reads the TP style of its name in
   `model.tp_plan` and the mesh (`peft/tuners/lora/model.py:100-127` `get_tp_plan_and_mesh`, stamped on the base
   layer at model.py:359-369). The adapter is sized from the base's local shard
   (`peft/tuners/tuners_utils.py:176-186` `_get_in_out_features`: a DTensor weight on a mesh with a "tp" dim gives
   `weight.to_local().shape`), then (model.py:398-440, `add_lora_tp_hooks_dtensor` model.py:130-162):
   - colwise base: `lora_B` (out/T, r) becomes a DTensor `Shard(0)` with the colwise forward installed; `lora_A`
     (r, in) stays a plain tensor, broadcast from TP rank 0 at init (`peft/tuners/lora/layer.py:355-378`);
   - rowwise base: `lora_A` (r, in/T) becomes `Shard(1)` with the rowwise forward; but it is an `nn.Linear` of
     the LOCAL in_features, and transformers' rowwise input hook builds the global input from `module.in_features`
     (`tensor_parallel.py:250-262`, `_from_local_last_dim_shard`): the forward fails ("shape '[32, 16]' is invalid
     for input of size 1024" on a 64-wide o_proj at T = 2). Refused (`llmem.support`).
   - any other style (phi3's `colwise_gather_output`, ...): no TP hooks (model.py:414-420 warns), the adapter sized
     from the local shard but added to a gathered output: the forward fails, refused (`llmem.derive.tp`).
   PEFT first and TP after does not run either: the plan names `q_proj.weight`, PEFT moved it to
   `q_proj.base_layer.weight`, so the base stays a plain tensor while the installed hook hands it a DTensor input
   ("aten.mm.default got mixed torch.Tensor and DTensor").
Gradients: the colwise hook turns the replicated input into a `Replicate` DTensor (`tensor_parallel.py:186-194`);
lora_B's matmul gives a `Partial` input gradient that `DTensor.from_local`'s backward all-reduces, so the plain
`lora_A` gets the same full gradient on every rank and no extra reduction runs; lora_B's gradient is its local
shard (a DTensor `Shard(0)`). AdamW keeps its states in the same layout (plain for A, sharded for B)."""

from __future__ import annotations

from torch import nn

from llmem.plan import TrainingPlan


def distribute(model: nn.Module, plan: TrainingPlan, device_type: str) -> nn.Module:
    """Step 1 of the module docstring: the base sharded by transformers' resolved plan and the attributes PEFT reads
    (`config.distributed_config`, `_device_mesh`, `_tp_size`) set as `maybe_distribute_model` sets them."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.configuration_utils import DistributedConfig

    from llmem.runtime.parallel import apply_hf_tp

    mesh = init_device_mesh(device_type, (plan.tp,), mesh_dim_names=("tp",))
    apply_hf_tp(model, mesh)
    model.config.distributed_config = DistributedConfig(tp_size=plan.tp)
    model._device_mesh = mesh
    model._tp_size = plan.tp
    return model


def prepare_lora_tp(model: nn.Module, plan: TrainingPlan, device_type: str) -> nn.Module:
    """TP first (`distribute`), then PEFT (`llmem.runtime.lora.apply_method`): the model the plan trains."""
    from llmem.runtime.lora import apply_method

    return apply_method(distribute(model, plan, device_type), plan)
