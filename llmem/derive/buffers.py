"""The model's buffers on one rank (a traced architecture): tensors the modules register beside their parameters,
allocated when the model is built, alive through the step, and no parameter of the inventory.

GPT-Neo's attention registers its causal mask, `torch.tril(torch.ones((max_positions, max_positions),
dtype=torch.bool))` (`nn.Buffer(bias, persistent=False)`, transformers 5.23 `models/gpt_neo/modeling_gpt_neo.py:69`):
max_position_embeddings² bytes per layer (1 MiB at 1024 positions); GPT-J's and CodeGen's attention its sinusoidal
table, max_positions × rotary_dim fp32 (`modeling_gptj.py:105`, `modeling_codegen.py:90`); the llama-like families
RoPE's inv_freq (a few hundred bytes). Counted by building the model on the meta device in the plan's parameter
dtype (`from_config(dtype=...)` makes it the default dtype while the modules are built, so a buffer made without an
explicit dtype takes it; GPT-J's table is fp32 by its own `dtype=torch.float32`): every buffer once
(`named_buffers`), its elements times its element size. Cached on disk per config and dtype.
"""

from __future__ import annotations

from llmem.derive import cache


def buffer_bytes(config: dict, dtype_name: str) -> int:
    """The bytes of every buffer of the model built from `config` in dtype `dtype_name` (e.g. "bfloat16")."""
    cached = cache.load(config, ("buffers", dtype_name))
    if cached is None:
        import torch
        from transformers import AutoModelForCausalLM

        from llmem.plan import TrainingPlan
        from llmem.quiet import quiet_libraries
        from llmem.runtime.model import hf_config

        with quiet_libraries(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(config, TrainingPlan()),
                                                     dtype=getattr(torch, dtype_name), trust_remote_code=False)
        total = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
        cached = cache.store(config, ("buffers", dtype_name), {"bytes": total})
    return cached["bytes"]
