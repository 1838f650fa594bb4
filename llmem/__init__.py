"""llmem: per-GPU memory of LLM fine-tuning, estimated byte by byte and checked against measured runs.

The public functions share their names with the submodules that hold them (`llmem.estimate.estimate`); importing
such a submodule would make Python bind the module over the function on this package, so the package refuses
that binding and `from llmem import estimate` is the function whatever was imported before (reach a submodule
with `from llmem.estimate import ...` or `sys.modules`, not `import llmem.estimate as m`).
"""

import sys
import types

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def estimate(spec, plan):
    from llmem.estimate import estimate as _estimate

    return _estimate(spec, plan)


def compare(spec, plan, capacity_bytes, variants=()):
    from llmem.compare import compare as _compare

    return _compare(spec, plan, capacity_bytes, variants=variants)


def plan_checkpointing(spec, plan, capacity_bytes):
    from llmem.checkpointing import plan_checkpointing as _plan_checkpointing

    return _plan_checkpointing(spec, plan, capacity_bytes)


__all__ = ["InputError", "ModelSpec", "TrainingPlan", "compare", "estimate", "plan_checkpointing"]


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name in __all__ and isinstance(value, types.ModuleType):
            return  # the submodule stays reachable as sys.modules["llmem." + name]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
