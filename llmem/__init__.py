"""llmem: per-GPU memory of LLM fine-tuning, estimated byte by byte and checked against measured runs."""

from llmem.errors import InputError
from llmem.plan import TrainingPlan

__all__ = ["InputError", "TrainingPlan"]
