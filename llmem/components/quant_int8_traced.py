"""`--quant int8` on a traced architecture: the inputs each 8-bit Linear's autograd node keeps (`ctx.A`) until the
step's outputs are dropped, read from the traced layer tables (`llmem.derive.int8`).

A decoder layer's traced table lists them (an input no op saves is an entry of its own, one an op saves too is
marked): while the layer's forward or backward runs they count with its table. They outlive its backward, so the
walk adds, at decoder layer L's backward, those of the layers whose backward already ran (above L) and those of the
checkpointed layers at or below L (a checkpointed layer keeps only its input from the forward, `kept_layers_bytes`,
but its first forward's 8-bit nodes hold theirs: checkpointing packs saved tensors, not node attributes); at the
forward's end those of the checkpointed layers; at the backward's end and the optimizer step all of them. (The
hand-written families' counterpart: `quant.held_input_bytes`.)
"""

from __future__ import annotations

from llmem.components.quant import is_int8
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    return is_int8(plan) and spec.derived is not None


def layer_held_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """Decoder layer `layer`'s inputs kept by its 8-bit Linears' nodes (of its kind, `Derived.layer_saved`)."""
    from llmem.components.activations import layer_plan
    from llmem.derive.int8 import held_bytes

    lp = layer_plan(plan, layer)
    return held_bytes(spec.derived.at(layer).layer_saved(lp))


def _per_layer(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    return spec.memo(("int8 traced held", plan.key), lambda: [layer_held_bytes(spec, plan, j)
                                                               for j in range(spec.num_layers)], per_plan=True)


def outside_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The held inputs of 8-bit Linears outside the decoder layers (opt's `project_out` after the final norm,
    `project_in` before the layers): in the traced `final` / `outer` tables, kept to the end like the layers'."""
    from llmem.derive.int8 import held_bytes

    return held_bytes(spec.derived.final_saved(plan)) + held_bytes(spec.derived.outer_saved(plan))


def forward_end_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At the forward's end, beyond the layers' kept activations: the checkpointed layers' held inputs."""
    if not applies(spec, plan):
        return 0
    return sum(h for j, h in enumerate(_per_layer(spec, plan)) if plan.checkpointed(j))


def during_backward_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """During decoder layer `layer`'s backward, beyond the layers' kept activations and its own (recomputed)
    saved tensors: the held inputs of the layers above it and of the checkpointed layers at or below it."""
    if not applies(spec, plan):
        return 0
    return sum(h for j, h in enumerate(_per_layer(spec, plan)) if j > layer or plan.checkpointed(j)) \
        + held_bytes_after_final(spec, plan)


def all_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """From the end of backward through the optimizer step: every layer's held inputs."""
    return sum(_per_layer(spec, plan)) + outside_bytes(spec, plan) if applies(spec, plan) else 0


def held_bytes_after_final(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Of `outside_bytes`, the part the walk no longer counts once the final norm's backward ran (the `final`
    table's; `outer` is counted through the layers' backward)."""
    from llmem.derive.int8 import held_bytes

    return held_bytes(spec.derived.final_saved(plan))
