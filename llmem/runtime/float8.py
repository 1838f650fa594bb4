"""`--float8 tensorwise|rowwise`: torchao's float8 training on the plan's model, as torchtitan's float8 converter
applies it (torchtitan `torchtitan/components/quantization/float8.py`, `utils.py` `module_filter_fn`): every
`nn.Linear` whose weight dims are both divisible by 16, except the output layer (transformers' `lm_head`), becomes
a `Float8Linear` with `Float8LinearConfig.from_recipe_name(recipe)` (torchao 0.18.0). Applied after the model is
built in its dtype and before it is wrapped for the scheme; the memory terms are `llmem.components.float8`."""

from __future__ import annotations

from torch import nn

from llmem.components.float8 import converted
from llmem.plan import TrainingPlan
from llmem.quiet import quiet_libraries

OUTPUT_LAYERS = ("lm_head",)  # torchtitan's filter_fqns names its output layer ("output")


def module_filter(module: nn.Module, fqn: str) -> bool:
    """torchtitan's `module_filter_fn`: a Linear with both dims divisible by 16 whose name is not the output's."""
    if not isinstance(module, nn.Linear):
        return False
    out_features, in_features = module.weight.shape
    return converted(in_features, out_features) and not any(name in fqn for name in OUTPUT_LAYERS)


def _import_torchao():
    """torchao's import logs a warning per CUDA extension it cannot load (a CPU-only machine has none to load):
    `llmem.quiet` silences those."""
    with quiet_libraries():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return Float8LinearConfig, convert_to_float8_training


def convert(model: nn.Module, plan: TrainingPlan) -> nn.Module:
    """Swap the filtered Linears for torchao's `Float8Linear` (in place); the model is returned."""
    config_cls, convert_to_float8_training = _import_torchao()
    config = config_cls.from_recipe_name(plan.float8.value)
    return convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
