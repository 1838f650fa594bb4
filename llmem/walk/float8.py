"""`--float8`: the moment of torchao's largest fp8 cast (`llmem.components.float8`) in the walk of one device, DDP
and ZeRO-1 (`single.py`): the last decoder layer's backward at down_proj, every saved tensor of the layer still
alive, its output gradient made, down_proj's input gradient made and its saved input being cast to fp8."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import activations as act
from llmem.components import communication as comm
from llmem.components import float8
from llmem.components.gradients import later_layers_gradient_bytes, layer_output_gradient_bytes
from llmem.walk.layer import held_bytes
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.single import Terms


def float8_moments(t: Terms, edges: list[tuple[int, str]]) -> list[Phase]:
    """Per evaluated layer (`edges`, from `single.backward_edges`): down_proj's input cast in its backward, over the
    layer's held tensors (`layer.held_bytes`), the outer activations, the head's and later layers' gradients and the
    layer output's gradient, as the MLP moment (`layer._mlp_moment`) reads them, less the MLP-output dropout's."""
    if not float8.applies(t.plan):
        return []
    spec, plan = t.spec, t.plan
    extra = float8.down_backward_extra_bytes(spec, plan)
    phases = []
    for layer, name in edges:
        lp, ls = act.layer_plan(plan, layer), act.layer_spec(spec, plan, layer)
        phases.append(moment(
            f"{name[:-1]}, float8 cast of down_proj's input)", **t.persistent,
            activations=held_bytes(t, layer) + t.outer_act - act.mlp_output_dropout_bytes(ls, lp),
            gradients=t.grads_outer + later_layers_gradient_bytes(spec, plan, layer)
            + layer_output_gradient_bytes(spec, plan) + extra["gradients"],
            temporaries=extra["temporaries"], logits=t.logits,
            communication=t.gathered(layer + 1) + comm.backward_transient_bytes(spec, plan)))
    return phases


def fsdp_float8_moments(w, layer: int, later: int, alive: int, communication: int) -> list[Phase]:
    """FSDP2 (`fsdp_layer`): the same moment on the compute plan (`fsdp.compute_plan`: unsharded bf16 tensors under
    the MixedPrecisionPolicy), over what the layer's MLP moment holds (`alive`: the layers' kept activations, the
    outer ones and the layer's own, less the MLP-output dropout's) and its gathered parameters and retained
    reduce-scatter input (`communication`). The float8 all-gather is not enabled (the recipes' default,
    `config.py:225`), so the gathered weights stay bf16."""
    if not float8.applies(w.plan):
        return []
    extra = float8.down_backward_extra_bytes(w.spec, w.cp)
    return [moment(f"backward (layer {layer}, float8 cast of down_proj's input)", **w.persistent, activations=alive,
                   gradients=w.root_grads_head + later + w.residual_grad + extra["gradients"],
                   temporaries=extra["temporaries"], logits=w.logits, communication=communication)]
