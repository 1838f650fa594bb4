"""llmem: per-GPU memory of LLM fine-tuning, estimated byte by byte and checked against measured runs."""

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def estimate(spec, plan):
    from llmem.estimate import estimate as _estimate

    return _estimate(spec, plan)


def compare(spec, plan, capacity_bytes):
    from llmem.compare import compare as _compare

    return _compare(spec, plan, capacity_bytes)


def plan_checkpointing(spec, plan, capacity_bytes):
    from llmem.checkpointing import plan_checkpointing as _plan_checkpointing

    return _plan_checkpointing(spec, plan, capacity_bytes)


__all__ = ["InputError", "ModelSpec", "TrainingPlan", "compare", "estimate", "plan_checkpointing"]
