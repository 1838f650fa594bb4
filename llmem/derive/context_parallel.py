"""What `--cp` reads of a traced architecture's tables (`llmem.derive.tables.Derived`; the terms themselves are
`llmem.components.context_parallel`'s). Pure Python: no torch."""

from __future__ import annotations

import re

from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

_BATCH_MONOMIALS = (0, 1, 4)  # b·s, b·s², b in `llmem.derive.fit.monomials`


def sdpa_backward_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int | None:
    """A decoder layer's backward when sdpa's backward kernel has returned q's, k's and v's gradients, on the terms of
    `Derived.backward_extra_bytes` (its window's live bytes at that event, `trace.Trace.sdpa`; with a gradient freed
    at its hook, the window with each added in place, as `accumulated_backward_extra_bytes`): the moment context
    parallelism's ring extends. None without an sdpa kernel in the window, or where the layer's backward is the
    checkpointed program's (traced LoRA with `--grad-ckpt full`)."""
    from llmem.components.gradients import freed_at_hook

    derived = spec.derived
    if "checkpointed backward" in derived.fitted(plan):
        return None
    saved = derived._saved(plan, "sdpa accumulating" if freed_at_hook(plan) else "sdpa")
    return saved[0].bytes if saved else None


def batch_free_outer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The tensors saved before the layers whose traced bytes do not grow with the batch (every batch monomial's
    coefficient 0 in their fit): those made from the position ids, which the trace's forward takes as transformers
    makes them without any, `cache_position.unsqueeze(0)`, one row — RoPE's cos and sin (rotary dim only, for a
    partial rotary). `--cp` passes per-sample position ids (`runtime.context_parallel.shard_inputs`), so they are
    batch × these."""
    fits = spec.derived.fitted(plan)["outer"]
    saved = spec.derived.outer_saved(plan)
    return sum(s.bytes for (_, c), s in zip(fits, saved, strict=True)
               if any(c) and not any(c[i] for i in _BATCH_MONOMIALS) and s.name != "input_ids (labels)")


def batch_free_layer_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """`batch_free_outer_bytes` of decoder layer `layer`'s own table: what a layer saves of the one-row position
    tables (glm4's interleaved cos and sin, `repeat_interleave`'s clones, saved per layer)."""
    derived = spec.derived
    fits = derived.fitted(plan)
    table = fits["kinds"][fits["layer_kinds"][layer]]["layer"]
    return sum(s.bytes for (_, c), s in zip(table, derived.at(layer).layer_saved(plan), strict=True)
               if any(c) and not any(c[i] for i in _BATCH_MONOMIALS))


def copies_attention_output(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether the traced layer's attention saves a `clone` (transformers' `attn_output.transpose(1, 2).contiguous()`
    copying sdpa's output for the output projection) without cp: where q enters sdpa contiguous in (batch, heads,
    seq, head_dim) — the partial rotary's `torch.cat` of the rotated and the passed half (phi, stablelm) — the
    kernel's output is laid out so too and is copied on every rank with or without cp, so cp's merge adds no copy
    (`components.context_parallel.attention_copy_bytes`)."""
    def copied(name: str) -> bool:
        saver, _, op = name.partition(": ")
        return re.search(r"\.self_attn\.\w+$", saver) is not None and op.startswith("clone ")
    return any(copied(s.name) for s in spec.derived.layer_saved(plan))
