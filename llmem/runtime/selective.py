"""`--grad-ckpt selective`: op-level selective activation checkpointing with torchtitan's policy.

torchtitan (pytorch/torchtitan, torchtitan/models/llama3/infra/parallelize.py at commit 81c1243,
`_apply_ac_to_transformer_block` with mode "selective" and selective_ac_option "op") wraps each transformer block in
non-reentrant `torch.utils.checkpoint` with `create_selective_checkpoint_contexts(policy)` and
`preserve_rng_state=False`. The policy saves (MUST_SAVE) the outputs of the ops in its save list and recomputes
(PREFER_RECOMPUTE) every other op in backward; of `aten.mm` it saves only the odd-numbered calls (it counts the mm
calls of each forward, and separately of each recompute, from 1 and saves when the count is odd). torch 2.13's
selective checkpoint asks the policy in the forward only and replays those decisions in the recompute, so the
recompute count is never read here.

Here the same policy wraps each decoder layer (transformers' `GradientCheckpointingLayer`, whose `forward` calls
`self._gradient_checkpointing_func(partial(forward, ...), *args)` when `gradient_checkpointing` is set). The save
list is torchtitan's plus one CPU op: `aten._scaled_dot_product_flash_attention_for_cpu` is what SDPA dispatches to
on CPU, the counterpart of the CUDA flash / memory-efficient attention ops, so it is saved as they are.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch import nn


def save_list() -> set:
    """torchtitan's `_save_list` (commit 81c1243) and the CPU flash-attention op (the CUDA ops' counterpart)."""
    ops = torch.ops
    return {
        ops.aten.mm.default,
        ops.aten._scaled_dot_product_efficient_attention.default,
        ops.aten._scaled_dot_product_flash_attention.default,
        ops._c10d_functional.reduce_scatter_tensor.default,
        ops.aten.max.default,
        ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }


def policy(meta: dict, saved: set):
    """torchtitan's `_custom_policy`: MUST_SAVE the listed ops except every second mm, PREFER_RECOMPUTE the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    def _policy(ctx, func, *args, **kwargs):
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        keep = func in saved and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return _policy


def context_fn():
    """A fresh mm count per checkpointed call, as torchtitan's `selective_checkpointing_context_fn`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy(defaultdict(int), save_list()))


def enable_selective(model: nn.Module) -> None:
    """Every decoder layer runs under non-reentrant checkpoint with the selective context (no RNG state kept)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    func = partial(checkpoint, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(layers) != int(model.config.num_hidden_layers):
        raise RuntimeError(f"{len(layers)} checkpointable layers, the config has {model.config.num_hidden_layers}")
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = func
