"""The LayerNorm decoders' attention-backward moments in the walk of one device, DDP, ZeRO-1 and TP
(`llmem.components.attention_backward`): the fused sdpa kernel's backward and the dropped probabilities' bmm
backward, each on the layer's own table, beside the layer's weight gradients made after its attention core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import activations as act
from llmem.components import attention_backward as ab
from llmem.components import attention_core as core
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.single import Terms


def attention_moments(t: Terms, layer: int, name: str, held: int, later: int) -> list[Phase]:
    """Layer `layer`'s moments: "sdpa backward" and "probabilities' bmm backward", where they apply."""
    spec, plan = t.spec, t.plan
    lp = act.layer_plan(plan, layer)
    items = tuple(act.layer_saved(spec, lp))
    terms = ab.moments(spec, plan, lp, items)
    copies = attention_copies(t, layer, core.eager_core_weight_copy_bytes(spec, plan))
    own = core.eager_core_layer_gradient_bytes(spec, plan)
    return [moment(f"{name[:-1]}, {what})", **t.persistent, activations=held + t.outer_act - released,
                   gradients=t.grads_outer + later + own + transient, temporaries=copies, logits=t.logits,
                   communication=t.gathered(layer + 1))
            for what, released, transient in terms]


def attention_copies(t: Terms, layer: int, own: int) -> int:
    """Autocast copies at a moment of layer `layer`'s attention backward (the eager core's softmax, sdpa's, q's RoPE
    and q_norm's, the LayerNorm decoders' sdpa and probabilities' bmm): the layers below's (`Terms.copies_below`,
    LoRA's layer-0 copies no mm saved already out) and `own`, this layer's whose MmBackward0 has not run yet (q/k/v's,
    or q_proj's) — none in LoRA's layer 0 when its input needs no gradient (`first_casts`,
    `lora.first_layer_unsaved_copy_bytes`: q/k/v read that input, so their mm saved no weight)."""
    return t.copies_below(layer) + (0 if layer == 0 and t.first_casts else own)
