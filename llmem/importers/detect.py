"""Which format a parsed file is: the first format module whose `matches` holds, in an order where the more specific
formats come first (a LLaMA-Factory or axolotl YAML also holds Trainer arguments; a DeepSpeed JSON holds
`gradient_accumulation_steps` like the Trainer's)."""

from __future__ import annotations

from types import ModuleType

from llmem.errors import InputError
from llmem.importers import accelerate, axolotl, deepspeed, llamafactory, peft, torchtune, trainer

FORMATS: tuple[ModuleType, ...] = (peft, torchtune, deepspeed, accelerate, llamafactory, axolotl, trainer)


def detect(tree: dict, name: str) -> ModuleType:
    for fmt in FORMATS:
        if fmt.matches(tree, name):
            return fmt
    hint = "; a model's config.json goes to --model" if "model_type" in tree else ""
    raise InputError(f"--from {name}", "not a training config llmem reads: expected a DeepSpeed JSON, an "
                     "accelerate config, Hugging Face TrainingArguments / TRL SFTConfig, a PEFT adapter_config.json, "
                     f"or an axolotl, LLaMA-Factory or torchtune YAML (docs/IMPORT.md){hint}")
