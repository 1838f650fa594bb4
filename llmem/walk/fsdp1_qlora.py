"""QLoRA in the FSDP1 walk (`--engine fsdp1 --method qlora`; `llmem.components.flat_qlora`): the FSDP2 walk's
QLoRA compute terms (the 4-bit Linears' weights are detached views: no weight gradients, the dequantized-weight
moments of one GPU) with FSDP1's flat buffers (`llmem.walk.fsdp1`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from llmem.components import Category, flat_qlora, quant
from llmem.components import activations as act
from llmem.walk.phase import Phase, with_extra

if TYPE_CHECKING:
    from llmem.walk.fsdp1 import Fsdp1Terms


def flat_qlora_terms(w: Fsdp1Terms, persistent: dict) -> Fsdp1Terms:
    """The FSDP2 walk's QLoRA terms (`w`, of the QLoRA plan) with FSDP1's persistent bytes, each layer's norms'
    saves for their weights' gradients (`flat_qlora.norm_weight_saved_bytes`, a checkpointed layer's in its
    recompute) and layer 0's own saving (`flat_qlora.first_layer_saving_bytes`); the frozen root holds no
    gradient."""
    spec, plan, cp = w.spec, w.plan, w.cp
    norms = flat_qlora.norm_weight_saved_bytes(spec, cp)
    first = 0 if act.checkpoints_layers(act.layer_plan(plan, 0)) else flat_qlora.first_layer_saving_bytes(
        spec, cp, w.half)
    kept_layers, current = w.kept_layers, w.current_layer

    def plain(count: int) -> int:  # layers 0 .. count-1 not checkpointed
        return sum(1 for layer in range(count) if not act.checkpoints_layers(act.layer_plan(plan, layer)))

    return replace(
        w, persistent=persistent, root_grads_head=0, first_saving=first,
        kept=w.kept + (0 if act.checkpoints_layers(plan) else norms),
        recompute=w.recompute + (norms if w.recompute else 0),
        kept_layers=lambda s, c, n: kept_layers(s, c, n) + plain(n) * norms,
        current_layer=lambda s, c, n: current(s, c, n) + norms,
        forward_acts=w.forward_acts + w.first_saving - first + plain(spec.num_layers) * norms)


def flat_qlora_moments(w: Fsdp1Terms, phases: list[Phase], held: dict[str, int]) -> list[Phase]:
    """A 4-bit Linear's dequantized weight (`quant.dequant_forward_bytes`, `dequant_backward_extra_bytes`) on top of
    the last layer's forward and each layer's backward moments (not the flat gradient's: the layer's compute is
    over by then), as in FSDP2's `fsdp.qlora_moments`."""
    if not quant.is_qlora(w.flat):
        return []
    spec, cp = w.spec, w.cp
    last = next(ph for ph in phases if ph.name == "forward (last layer)")
    out = [with_extra(last, f"forward (last layer), {quant.forward_moment_label(cp)}", Category.TEMPORARIES,
                      quant.dequant_forward_bytes(spec, cp))]
    held[out[0].name] = held.get(last.name, 0)  # (the gradient shards micro-step 1 holds there: --grad-accum)
    extra = quant.dequant_backward_extra_bytes(spec, cp)
    for ph in phases:
        if ph.name.startswith("backward (layer") and "pre-backward" not in ph.name and "flat gradient" not in ph.name:
            out.append(with_extra(ph, f"{ph.name}, {quant.bits(cp)} weight dequantized", Category.TEMPORARIES, extra))
            held[out[-1].name] = held.get(ph.name, 0)
    return out

