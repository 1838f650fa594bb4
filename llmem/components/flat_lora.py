"""LoRA under FSDP1 (`--engine fsdp1 --method lora`): what a decoder layer keeps when its frozen base and its
trainable adapters share one FlatParameter (torch 2.13 `torch/distributed/fsdp/_flat_param.py`).

With `use_orig_params=True` a unit may mix frozen and trainable tensors, and its FlatParameter requires grad when
any of them does (`_validate_tensors_to_flatten`, `_flat_param.py:832`). In forward every original parameter is a
`split(...).view(...)` of the unsharded flat parameter (`_get_unflat_views_aligned`, `_flat_param.py:1935`, set by
`_use_unsharded_views(as_params=False)`, `_flat_param.py:1995`), so the frozen base's views require grad as well:
autograd computes the base weights' gradients as full fine-tuning does, and each op saves what full fine-tuning's
saves (a base Linear its input, a norm its normalized input). So a layer keeps full fine-tuning's table
(`activations.layer_saved`) plus what only its adapters save (LoRA's table, `lora_activations.layer_saved`, less
the entries full fine-tuning's table already holds, and less lora_A's save of x, the tensor the base Linear saves
already). Under MixedPrecision the adapters are cast with the flat parameter and compute in the half dtype
(`half`, as under FSDP2's MixedPrecisionPolicy).

The root (embeddings, final norm, lm_head) holds no adapter: its FlatParameter does not require grad, so the final
norm and lm_head save what LoRA's do (`lora_activations.final_norm_saved`), and layer 0's input (the frozen
embeddings' output) requires no grad unless PEFT's input-require-grads hook runs (`embeddings_require_grad`, under
checkpointing). Without it layer 0's input norm saves only `weight * normalized`'s `normalized` (the weight's view
requires grad), not the residual stream and rsqrt its input gradient would need (`first_layer_saving_bytes`), and no
gradient of layer 0's input is made. The walk's LoRA moments (`llmem.walk.fsdp1`): down_proj's adapter branch
(`down_proj_terms`), the frozen final norm's backward (`norm_backward.final_norm_backward_bytes`).

Measured on 2-3 CPU ranks (gloo): llama, qwen2, qwen3, gemma, mistral; NO_SHARD, SHARD_GRAD_OP, FULL_SHARD; fp32 and
bf16-mixed; checkpointed or not; q/v, o/down and all-linear targets; eager; --ckpt-every 2: within 0.06 %. QLoRA:
`flat_qlora` (the codes stored as bf16, the base's views detached). Not modelled: module copies (`modules_to_save`),
traced LoRA tables (gpt2 measured -2.4 %), MoE; a half base is refused with PEFT's fp32 adapters (two dtypes in one
unit) and runs with `--lora-adapter-dtype base` (one dtype: the adapters compute in it, `spec.half_adapters`;
docs/MODEL-LORA-DTYPE.md).
"""

from __future__ import annotations

from llmem.components import activations as act
from llmem.components import lora
from llmem.components.lora_activations import _NEEDS, embeddings_require_grad
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def full_plan(plan: TrainingPlan) -> TrainingPlan:
    """The same plan fine-tuning every parameter: the program autograd runs on the layers' views."""
    return plan.with_(method=Method.FULL)


def half(plan: TrainingPlan) -> bool:
    """MixedPrecision casts the whole flat parameter, adapters included, to param_dtype (`_use_low_precision_shard`):
    the adapters compute in the half dtype under every sharding strategy, NO_SHARD's too."""
    return plan.precision.is_mixed


def adapter_saved(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> list:
    """What one layer's adapters save beyond full fine-tuning's table (`plan` the LoRA plan, `cp` its compute plan:
    LoRA's table of a layer whose input requires grad, less full fine-tuning's entries and lora_A's save of x)."""
    full = {s.name for s in act.layer_saved(spec, cp)}
    return [s for s in lora.layer_saved(spec, cp, first=False, half=half(plan))
            if s.name not in full and not s.name.endswith("input kept by lora_A")]


@per_spec()
def adapter_saved_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> int:
    return sum(s.bytes for s in adapter_saved(spec, plan, cp))


def layer0_input_requires_grad(plan: TrainingPlan) -> bool:
    """Under checkpointing PEFT's input-require-grads hook makes the embeddings' output require grad
    (`embeddings_require_grad`); otherwise nothing computes layer 0's input gradient."""
    return embeddings_require_grad(plan) or act.checkpoints_layers(plan)


@per_spec()
def first_layer_saving_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> int:
    """How much less layer 0 keeps than the others when its input requires no grad (no checkpointing): full
    fine-tuning's entries only the layer input's gradient needs (`lora_activations._NEEDS` "input")."""
    if layer0_input_requires_grad(plan):
        return 0
    return sum(s.bytes for s in act.layer_saved(spec, cp) if _NEEDS.get(s.name) == "input")


@per_spec()
def final_norm_saving_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan, cp_full: TrainingPlan) -> int:
    """The frozen root's final norm and lm_head save less than full fine-tuning's (`lora.final_norm_saved`)."""
    return act.final_norm_bytes(spec, cp_full) - lora.final_norm_bytes(spec, cp)


def kept_layers_bytes(spec: ModelSpec, plan: TrainingPlan, cp_full: TrainingPlan, cp: TrainingPlan, count: int) -> int:
    """What layers 0 .. count-1 keep from forward to backward (layer 0's saving not taken off, as the FSDP2 walk's
    LoRA terms): full fine-tuning's, and each layer that is not checkpointed its adapters' own saves."""
    plain = sum(1 for layer in range(count) if not act.checkpoints_layers(act.layer_plan(plan, layer)))
    return act.kept_layers_bytes(spec, cp_full, count) + plain * adapter_saved_bytes(spec, plan, cp)


def current_layer_backward_bytes(spec: ModelSpec, plan: TrainingPlan, cp_full: TrainingPlan, cp: TrainingPlan,
                                 layer: int) -> int:
    """What layer `layer` holds in its backward: full fine-tuning's (its recompute's, checkpointed) and its
    adapters' saves (a checkpointed layer's recompute saves them again)."""
    return act.current_layer_backward_bytes(spec, cp_full, layer) + adapter_saved_bytes(spec, plan, cp)


def adapts_down_proj(spec: ModelSpec, plan: TrainingPlan) -> bool:
    return any(p.name.endswith("down_proj.weight") for p in lora.layer0_targeted(spec, plan))


@per_spec()
def down_proj_terms(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> tuple[int, int, int, int]:
    """down_proj adapted: its output is `base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`, and autograd runs
    the adapter branch first (its nodes were made last); a node's saved tensors are released once it ran. Returns
    (its adapter's saves, which that branch frees before the base Linear's backward: dropout noise and output,
    lora_A's output, the scaling; of them, those freed before lora_A's backward, by the scaling mul and lora_B;
    its adapter's gradients, r·(i + h) in the compute dtype, waiting in the flat parameter's SplitWithSizesBackward;
    inside lora_A's backward, its input's gradient and its output's, tokens·(i + r) in the compute dtype). Under
    checkpointing the scaling mul is the first node that unpacks a saved tensor: the layer is recomputed first."""
    own = [s for s in adapter_saved(spec, plan, cp) if s.name.startswith("down_proj")]
    before = sum(s.bytes for s in own if s.name.startswith(("down_proj: lora_A output", "down_proj: scaling")))
    cb, tokens = cp.precision.compute_bytes, plan.batch_size * plan.seq_len
    grads = lora.largest_mlp_adapter_bytes(spec, plan, cb)
    return sum(s.bytes for s in own), before, grads, tokens * (spec.intermediate_size + plan.lora_rank) * cb


def check_model(spec: ModelSpec, plan: TrainingPlan) -> None:
    """LoRA / QLoRA under FSDP1 NO_SHARD (`--zero 0`, one GPU) without MixedPrecision on tied embeddings: the real
    program stops in the second step's forward (the first runs). The frozen root's post-forward reshard calls
    `_use_sharded_views`, which under NO_SHARD re-registers the unsharded views as parameters
    (`_use_unsharded_views(as_params=True)`), and the tied lm_head's primary, a plain tensor by then, fails its check
    (torch 2.13 `fsdp/_flat_param.py:2021-2025`: "as_params=True type(prim_param)=Tensor"; measured on CPU: qwen2,
    gemma, tied llama; any device). Under MixedPrecision the low-precision shard path runs instead (it trains)."""
    from llmem.components.flat_param import sharded
    from llmem.errors import REFUSED, InputError
    from llmem.plan import Engine

    if (plan.engine is Engine.FSDP1 and lora.is_lora(plan) and spec.tie_word_embeddings and not sharded(plan)
            and not plan.precision.is_mixed):
        raise InputError("zero", f"FSDP1 NO_SHARD over {spec.model_type!r}'s tied embeddings in LoRA's frozen root "
                         "raises 'as_params=True type(prim_param)=Tensor' in the second step's forward (the tied "
                         "lm_head's views re-registered as parameters); use --zero 3 on 2+ GPUs, --precision "
                         "bf16-mixed (LoRA), or --engine torch", REFUSED)
