"""Build the model of a plan: `AutoModelForCausalLM.from_config`, directly in its target dtype (DESIGN.md §1)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from llmem.errors import REFUSED, InputError
from llmem.plan import Loss, TrainingPlan


def hf_config(config: dict, plan: TrainingPlan):
    """A transformers config from a plain config dict, with `use_cache=False` and the plan's attention."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    if not isinstance(config, dict):
        raise InputError("model", f"expected a config dict, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not model_type:
        raise InputError("model", "the config has no 'model_type'")
    # a copy: transformers standardizes nested dicts in place (`rope_scaling` gains `rope_type`, `rope_theta`), which
    # would change the caller's config, the derived tables' cache key (`llmem.derive.cache._path`)
    rest = copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "architectures",
                                                                       "transformers_version")})
    try:
        cfg = AutoConfig.for_model(model_type, **rest)
    except (ValueError, TypeError, StrictDataclassError) as exc:  # the config classes' validators (one line here)
        cause = exc.__cause__ or exc
        raise InputError("model", f"transformers cannot build model_type {model_type!r}: "
                         f"{' '.join(str(cause).split())}") from None
    cfg.use_cache = False
    return cfg


def build_model(config: dict, plan: TrainingPlan, device: torch.device | str = "cpu") -> nn.Module:
    """The model, built on `device` in the plan's parameter dtype (fp32 for mixed precision), in train mode."""
    from transformers import AutoModelForCausalLM

    from llmem.spec import attention_implementation

    cfg = hf_config(config, plan)
    dtype = getattr(torch, plan.precision.torch_dtype_name)
    if plan.loss is Loss.FUSED_LINEAR_CE:
        apply_fused_linear_ce(cfg.model_type)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation=attention_implementation(cfg.model_type, plan.attn))
        except ValueError as exc:
            raise InputError("attn", str(exc).splitlines()[0]) from None
    model.config.use_cache = False
    model.train()
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list (`model.model.layers`, `transformer.h`, `gpt_neox.layers`, …): the longest ModuleList
    whose children are the classes transformers declares as not splittable, or, where the model declares none
    (transformers 5.23 `BioGptPreTrainedModel` has no `_no_split_modules`), transformers' checkpointable decoder
    layers (`modeling_layers.GradientCheckpointingLayer`, what `gradient_checkpointing_enable` checkpoints)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    names = set(getattr(model, "_no_split_modules", None) or [])

    def is_layer(m: nn.Module) -> bool:
        return type(m).__name__ in names if names else isinstance(m, GradientCheckpointingLayer)

    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and is_layer(module[0]):
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise InputError("model", f"cannot find the decoder layers of {type(model).__name__}")
    return best


def apply_fused_linear_ce(model_type: str) -> None:
    """`--loss fused-linear-ce`: Liger-Kernel patches only the causal-LM forward of the family (its other kernels
    off), before the model is built. Needs the `liger-kernel` package and CUDA (Triton); not installed here."""
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError:
        raise InputError("loss", "fused-linear-ce needs the liger-kernel package (and a CUDA GPU) to run; "
                         "use --loss standard") from None
    apply = getattr(monkey_patch, f"apply_liger_kernel_to_{model_type}", None)
    if apply is None:
        raise InputError("loss", f"Liger-Kernel has no fused-linear-ce patch for {model_type!r}; use --loss standard",
                         REFUSED)
    import inspect

    # every other kernel switch of the family (rope, rms_norm, swiglu/geglu, cross_entropy, …) off
    switches = {name: False for name, p in inspect.signature(apply).parameters.items() if p.default is True
                or (p.default is False and name != "fused_linear_cross_entropy")}
    apply(**switches, fused_linear_cross_entropy=True)
