"""Architectures outside the hand-written families (`llmem.families`), derived from transformers itself.

`derived_spec(config)` counts the parameters on the meta device (`llmem.meta`) and attaches a `Derived`: the
activation tables the estimator's walk asks for (one decoder layer's saved tensors, those before and after the
layers, the tensors a checkpointed layer's arguments keep), traced from the real model on fake tensors
(`llmem.derive.trace`) at a few (batch, seq) points and fitted exactly (`llmem.derive.fit`). Traces are cached per
config, library versions, precision and attention, in memory and on disk (`llmem.derive.cache`).
Imports torch only when a table is first asked for.
"""

from __future__ import annotations

from llmem.derive.tables import Derived, derived_spec, is_cached

__all__ = ["Derived", "derived_spec", "is_cached"]
