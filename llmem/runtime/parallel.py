"""Wrap a built model for its scheme, exactly as docs/DESIGN.md section 2 says.

| scheme    | wrapping                                                                                 |
|-----------|------------------------------------------------------------------------------------------|
| single    | none                                                                                     |
| ddp       | `DistributedDataParallel` (default bucket size)                                          |
| zero1     | DDP; the optimizer is `ZeroRedundancyOptimizer` (see optim.py)                           |
| zero2/3   | FSDP2 `fully_shard(reshard_after_forward=False/True)` on each decoder layer, then the root |
| tp        | the hand-written unfused families (`Family.tp_plan`): `parallelize_module` per decoder layer,  |
|           | q/k/v/gate/up colwise, o/down rowwise. Every other model: the plan of its own config          |
|           | (`base_model_tp_plan`, with the embeddings vocab-sharded and the lm_head `colwise_gather_output`) |
|           | applied by transformers itself (`hf_tp_plan`, `apply_tensor_parallelism`)                     |
| tp+zero3  | 2-D mesh (dp, tp): the TP plan on "tp", then FSDP2 (reshard after forward) on "dp"        |
| fsdp1     | (`--engine fsdp1`, zero0/2/3) `FullyShardedDataParallel` as accelerate's FSDP plugin builds it: |
|           | `transformer_auto_wrap_policy` over the decoder layer classes plus the root, SHARD_GRAD_OP / |
|           | FULL_SHARD, use_orig_params, limit_all_gathers, BACKWARD_PRE, no forward prefetch           |

QLoRA (DDP, ZeRO-1, FSDP2 ZeRO-2/3; not TP): FSDP2 shards each `Params4bit`'s packed uint8 codes like any
parameter (the `Linear4bit` module keeps the whole `quant_state` and gives it back to the gathered weight); DDP's
construction broadcasts the `Params4bit` packed codes like any parameter (their
`quant_state` is not sent; every rank builds the same base, so nothing changes), and buckets only the adapters.

Mixed precision is fp32 parameters + `torch.autocast` (session.py), except under FSDP2 where
`MixedPrecisionPolicy(param_dtype=<half>, reduce_dtype=float32)` casts instead and no autocast runs; under FSDP1,
`MixedPrecision(param_dtype=<half>, reduce_dtype=<half>, buffer_dtype=<half>)` (accelerate's
`FullyShardedDataParallelPlugin.set_mixed_precision`), no autocast either.
"""

from __future__ import annotations

import torch
from torch import nn

from llmem.errors import REFUSED, InputError
from llmem.plan import Engine, Scheme, TrainingPlan
from llmem.runtime.model import decoder_layers

FSDP_SCHEMES = (Scheme.ZERO2, Scheme.ZERO3, Scheme.TP_ZERO3)


def uses_fsdp(plan: TrainingPlan) -> bool:
    """FSDP2, or FSDP1 (`--engine fsdp1`, NO_SHARD included): their mixed precision casts, no autocast runs."""
    return plan.scheme in FSDP_SCHEMES or plan.engine is Engine.FSDP1


def check_supported(model_type: str, plan: TrainingPlan, config: dict | None = None) -> None:
    """Raise InputError for a plan this runtime cannot run on this model (before anything is built). Tensor
    parallelism needs a TP plan: a hand-written unfused family's (`Family.tp_plan`) or the config's own
    `base_model_tp_plan`; and the TP degree must divide the attention heads (each rank runs whole heads)."""
    if plan.tp <= 1:
        return
    from llmem.families import FAMILIES

    family = FAMILIES.get(model_type)
    if (family is None or not family.tp_plan) and config is not None and not config_tp_plan(config):
        raise InputError("tp", f"{model_type!r} has no tensor-parallel plan (its config's base_model_tp_plan is "
                         "empty), so transformers cannot shard it; use --tp 1 (DDP or ZeRO)", REFUSED)
    if config is not None:
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads") or heads
        inter = config.get("intermediate_size") if family is not None and family.tp_plan else None
        for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                            ("intermediate_size", inter)):
            if isinstance(value, int) and value % plan.tp:
                raise InputError("tp", f"TP degree {plan.tp} must divide {name} = {value}")


def config_tp_plan(config: dict) -> dict:
    """The config's `base_model_tp_plan` (its configuration class's when the dict does not carry it)."""
    from llmem.runtime.model import hf_config

    return dict(getattr(hf_config(config, TrainingPlan()), "base_model_tp_plan", None) or {})


def uses_hf_plan(model_type: str) -> bool:
    """Whether TP applies transformers' plan of the model (not a hand-written unfused family's `tp_layer_plan`)."""
    from llmem.families import FAMILIES

    family = FAMILIES.get(model_type)
    return family is None or not family.tp_plan


def hf_tp_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """transformers 5.23's own resolved TP plan of `model`, one entry per module or parameter, as
    `from_pretrained(tp_plan="auto")` resolves it (`transformers/distributed/mixin.py`:
    `PreTrainedModel._resolve_parallel_plans(DistributedConfig(tp_size=tp))`): the config's `base_model_tp_plan`,
    the causal LM's `_tp_plan` (`lm_head: colwise_gather_output`) and `embed_tokens: embedding_rowwise`."""
    from transformers.distributed.configuration_utils import DistributedConfig

    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))
    return tp_plan


def tp_layer_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _apply_tp(model: nn.Module, tp_mesh) -> None:
    """A hand-written unfused family: `parallelize_module` per decoder layer (`tp_layer_plan`). Any other model:
    transformers' `apply_tensor_parallelism` (`transformers/distributed/tensor_parallel.py`, what
    `maybe_distribute_model` runs for `tp_plan="auto"`) with its resolved plan (`hf_tp_plan`): its styles shard
    each parameter in place (`distribute_tensor(..., src_data_rank=None)`: every rank slices its own identical
    copy) and hook the forwards."""
    from torch.distributed.tensor.parallel import parallelize_module

    if uses_hf_plan(str(getattr(model.config, "model_type", ""))):
        apply_hf_tp(model, tp_mesh)
        return
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, tp_layer_plan())


def apply_hf_tp(model: nn.Module, tp_mesh) -> None:
    """transformers' `apply_tensor_parallelism` with the model's resolved plan (`hf_tp_plan`); a tied lm_head is
    sharded once, with the embedding (see `_apply_tp`)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = hf_tp_plan(model, tp_mesh.size())
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    names = {m: n for n, m in model.named_modules()}
    if tied:  # `from_pretrained` shards before it ties (`init.no_tie_weights`, then `tie_weights`): shard once
        plan.pop(f"{names[head]}.weight", None)
    apply_tensor_parallelism(model, tp_mesh, plan)
    if tied:
        model.tie_weights()


def _apply_fsdp(model: nn.Module, plan: TrainingPlan, dp_mesh, reshard: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    if plan.precision.is_mixed:
        half = getattr(torch, plan.precision.compute_dtype_name)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    from llmem.plan import FsdpShard, Offload

    if plan.offload is Offload.OPTIMIZER_PARAMS:  # sharded params, grads and optimizer states in pinned host memory
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    if plan.fsdp_shard is FsdpShard.DIM1_IF_SHORT:
        kwargs["shard_placement_fn"] = _dim1_if_short(dp_mesh.size())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _dim1_if_short(dp: int):
    """`--fsdp-shard dim1-if-short`: Shard(1) for a tensor with fewer dim-0 rows than ranks whose dim 1 divides
    evenly (the same rule as `llmem.components.sharding.fsdp_shard_dim`); None keeps FSDP2's Shard(0)."""
    from torch.distributed.tensor import Shard

    def placement(param):
        short = param.ndim >= 2 and param.size(0) < dp and param.size(1) % dp == 0
        return Shard(1) if short else None

    return placement


def _wrap_fsdp1(model: nn.Module, plan: TrainingPlan, device_type: str) -> nn.Module:
    """`--engine fsdp1`: `FullyShardedDataParallel` with accelerate's FSDP plugin settings
    (`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP` over the decoder layer classes, `fsdp_use_orig_params: true`,
    `limit_all_gathers=True`, `backward_prefetch=BACKWARD_PRE`, `forward_prefetch=False`): one FlatParameter per
    decoder layer and one for the root (embeddings, final norm, lm_head). ZeRO-0 = NO_SHARD, ZeRO-2 =
    SHARD_GRAD_OP, ZeRO-3 = FULL_SHARD. `--fsdp1-wrap adapters`: each trainable leaf (lora_A / lora_B Linear) a unit
    of its own besides, use_orig_params=False (Answer.AI fsdp_qlora train.py `get_wrapping_policy`)."""
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    layer_classes = {type(layer) for layer in decoder_layers(model)}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes)
    adapters = plan.fsdp1_wrap.value == "adapters"
    if adapters:  # `--fsdp1-wrap adapters`: PEFT 0.21.2 `utils/other.py` `fsdp_auto_wrap_policy`'s lambda policy
        from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

        def trainable_leaf(module: nn.Module) -> bool:
            return (not list(module.named_children()) and getattr(module, "weight", None) is not None
                    and module.weight.requires_grad)

        policy = functools.partial(_or_policy, policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf), policy])
    mixed = None
    if plan.precision.is_mixed:
        half = getattr(torch, plan.precision.compute_dtype_name)
        mixed = MixedPrecision(param_dtype=half, reduce_dtype=half, buffer_dtype=half)
    # one GPU: FSDP switches any strategy to NO_SHARD at world size 1 (torch 2.13 fsdp/_init_utils.py:430-438)
    strategy = {Scheme.ZERO3: ShardingStrategy.FULL_SHARD, Scheme.ZERO2: ShardingStrategy.SHARD_GRAD_OP,
                Scheme.DDP: ShardingStrategy.NO_SHARD, Scheme.SINGLE: ShardingStrategy.NO_SHARD}[plan.scheme]
    if plan.gpus == 1:
        from llmem.runtime.deepspeed import _one_rank_group

        _one_rank_group(plan)  # its process group of one (torchrun --nproc_per_node 1 makes it under `measure`)
    device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, torch.cuda.current_device())
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, mixed_precision=mixed,
                device_id=device, use_orig_params=not adapters, limit_all_gathers=True,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False)


def wrap(model: nn.Module, plan: TrainingPlan, device_type: str = "cpu") -> nn.Module:
    """The model wrapped for `plan.scheme`; the default process group must be initialised for multi-rank."""
    scheme = plan.scheme
    if plan.engine is Engine.FSDP1:  # one GPU included: FSDP1 wraps a world of one
        return _wrap_fsdp1(model, plan, device_type)
    if scheme is Scheme.SINGLE or plan.engine is Engine.DEEPSPEED:  # DeepSpeed wraps in its own engine
        return model
    from torch.distributed.device_mesh import init_device_mesh

    if scheme in (Scheme.DDP, Scheme.ZERO1):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, gradient_as_bucket_view=plan.ddp_bucket_view)
    if scheme in (Scheme.ZERO2, Scheme.ZERO3):
        mesh = init_device_mesh(device_type, (plan.gpus,))
        _apply_fsdp(model, plan, mesh, reshard=scheme is Scheme.ZERO3)
        return model
    if scheme is Scheme.TP:
        _apply_tp(model, init_device_mesh(device_type, (plan.tp,)))
        return model
    mesh = init_device_mesh(device_type, (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))
    _apply_tp(model, mesh["tp"])
    _apply_fsdp(model, plan, mesh["dp"], reshard=True)
    return model
