"""`--lora-modules-to-save` under FSDP2 (ZeRO-2/3): PEFT's trainable copies are parameters of the root group.

`llmem.runtime.parallel._apply_fsdp` calls `fully_shard` on each decoder layer and then on the model, so every
parameter outside the layers — the frozen embedding, final norm and lm_head, and the `ModulesToSaveWrapper`'s
trainable `modules_to_save["default"]` beside its frozen `original_module` (peft 0.21.2 `peft/utils/other.py`) —
is one FSDP parameter of the root group (torch 2.13 `_fully_shard/_fsdp_init.py: _get_managed_states` skips only
modules already managed by a layer's `fully_shard`). A copy is therefore, on one rank:
  - sharded like any root parameter (dim-0 padded shard, `FSDPParam._init_sharded_param`), in the plan's parameter
    dtype, and its gradient after the root's reduce-scatter a shard of the same size
    (`_fsdp_collectives.py:704-754`: `new_sharded_grad` viewed out of the reduce-scatter output, cast to the
    sharded parameter's dtype, set as `sharded_param.grad`); the optimizer's states are of that shard;
  - all-gathered with the root (its frozen original too, although only the copy runs in forward) in the
    MixedPrecisionPolicy's param_dtype, or its own dtype;
  - unsharded in backward: autograd's gradient of the unsharded copy in the param_dtype, held from the copy's
    backward to the root's post-backward, whose `foreach_reduce` copies it into the root's `reduce_scatter_input`
    (world × padded shard in the reduce dtype, `_fsdp_collectives.py:597`).
Measured in fp32, bf16-mixed and pure bf16 (tests/components/test_lora_copies_fsdp.py); with `--offload` the copies
would move to the host with the root's shards: not measured, a gap in `llmem.support`."""

from __future__ import annotations

from llmem.components.lora_copies import copy_bytes, module_copies
from llmem.components.sharding import FSDP_SCHEMES, fsdp_shard_numel
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec


def applies(plan: TrainingPlan) -> bool:
    """The plan trains module copies under FSDP2."""
    from llmem.components.lora import is_lora

    return plan.scheme in FSDP_SCHEMES and is_lora(plan) and bool(plan.lora_modules_to_save)


@per_spec("layout_key")
def sharded_copy_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Elements of the copies' padded shards on one rank (`fsdp_shard_numel`, as every root parameter)."""
    if not applies(plan):
        return 0
    return sum(fsdp_shard_numel(c.shape, plan) for c in module_copies(spec, plan))


def sharded_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The copies' shards (parameters), in the plan's parameter dtype; their reduce-scattered `.grad`s are as large."""
    return sharded_copy_numel(spec, plan) * plan.precision.param_bytes


def gathered_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The copies' share of the root's all-gather output and unsharded parameters: dp padded shards each, in the
    MixedPrecisionPolicy's param_dtype (else the parameter dtype)."""
    elem = plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes
    return sharded_copy_numel(spec, plan) * plan.dp * elem


def copy_reduce_scatter_input_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The copies' share of the root's `reduce_scatter_input`: dp padded shards each in the reduce dtype (fp32 under
    a MixedPrecisionPolicy with `reduce_dtype=float32`, else the parameter dtype)."""
    elem = 4 if plan.precision.is_mixed else plan.precision.param_bytes
    return sharded_copy_numel(spec, plan) * plan.dp * elem


@per_spec("layout_key")
def unsharded_copy_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Autograd's gradients of the unsharded copies (their unpadded shape, in the param_dtype: the compute dtype
    under a MixedPrecisionPolicy), alive until the root's post-backward copies them into its reduce-scatter input."""
    if not applies(plan):
        return 0
    elem = plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes
    return sum(c.numel for c in module_copies(spec, plan)) * elem


@per_spec("layout_key")
def head_copy_unsharded_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The lm_head copy's unsharded gradient (param_dtype), still referenced through the root's reduce-scatter after
    the copy-in, as an untied lm_head weight's is under full fine-tuning (`llmem.walk.fsdp_root.root_reduce_moment`);
    the embedding copy's is freed. Measured: an untied llama (vocab 4000, 2 ranks, bf16-mixed) holds its 512,000 B
    bf16 lm_head copy gradient beside the root's reduce_scatter_input and gloo's copy of it."""
    if not applies(plan):
        return 0
    elem = plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes
    return copy_bytes(spec, plan, "head") // plan.precision.param_bytes * elem
