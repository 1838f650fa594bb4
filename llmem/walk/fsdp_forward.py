"""The forward's all-gathers in the FSDP2 walk (`fsdp.py`): the root's, layer 0's, and a later layer's all-gather and
copy-out, each group at its own size (`communication.layer_unsharded_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import activations as act
from llmem.components import lora, moe_forward
from llmem.plan import Scheme
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.fsdp import FsdpTerms


def forward_gather_moments(w: FsdpTerms) -> list[Phase]:
    """The start of forward: the root's pre-forward all-gather (the step's input_ids alive), its copy-out (the output
    beside the new unsharded storage); then, with the embeddings' output (layer 0's input) alive, layer 0's
    all-gather and copy-out while the root's output is still retained (`all_gather_state`) beside the root's
    unsharded parameters. Each copy-out frees the retained output only when it returns (`wait_for_unshard` holds
    it in a local), so later forward all-gathers and copy-outs hold one retained layer output, the previous
    layer's (`layer_gather_moments`)."""
    rg = w.root_gather
    masks = sdpa_masks(w)  # built before layer 0 runs
    start = dict(**w.persistent, activations=w.ids)
    layer0 = dict(**w.persistent, activations=w.outer_act + w.hidden + masks)
    return [
        moment("forward (root all-gather)", **start, communication=w.root_all_gather),
        moment("forward (root all-gather copy-out)", **start, communication=2 * rg + w.root_copy_out),
        moment("forward (layer 0 all-gather)", **layer0, communication=2 * rg + w.layer_all_gathers[0]),
        moment("forward (layer 0 all-gather copy-out)", **layer0,
               communication=2 * rg + 2 * w.layer_gathers[0] + w.layer_copy_outs[0]),
    ] + [ph for layer in gather_layers(w) for ph in layer_gather_moments(w, layer)]


def gather_layers(w: FsdpTerms) -> list[int]:
    """The layers l > 0 whose forward all-gather is evaluated: the last one of each set of gather terms (layer l - 1's
    retained output, layer l's all-gather, copy-out and unsharded parameters). The activations kept and, under
    ZeRO-2, the layers still gathered only grow with l, so among layers of equal terms the last one holds the most:
    the last layer alone when the layers are of one size."""
    last = {}
    for layer in range(1, w.layers):
        key = (w.layer_gathers[layer - 1], w.layer_all_gathers[layer], w.layer_copy_outs[layer],
               w.layer_gathers[layer])
        last[key] = layer
    return sorted(last.values())


def layer_gather_moments(w: FsdpTerms, layer: int) -> list[Phase]:
    """Layer `layer`'s forward all-gather and copy-out (ZeRO-2 keeps every earlier layer gathered, ZeRO-3 only the
    activations grow); its copy-out: `wait_for_unshard` binds the retained output of layer - 1 to a local
    (`prev_all_gather_state`, torch 2.13 `_fully_shard/_fsdp_param_group.py:430-432`), so it is freed only when the
    copy-out returns."""
    spec, plan, cp = w.spec, w.plan, w.cp
    hand_lora = lora.is_lora(plan) and spec.derived is None  # (traced LoRA: layer 0 is a layer kind of its own)
    earlier_layers = layer * w.kept - w.first_saving if hand_lora else act.kept_layers_bytes(spec, cp, layer)
    unsharded = sum(w.layer_gathers[:layer]) if plan.scheme is Scheme.ZERO2 else 0
    # the model's forward holds the embeddings' output (`inputs_embeds`) through its layer loop: extra where no
    # op of layer 0 saves it (LoRA: layer 0's input needs no grad; a half-precision RMSNorm saves its fp32 copy)
    embeds = 0
    if not act.checkpoints_layers(plan) and (lora.is_lora(plan) or not act.saves_layer_input(spec, cp)):
        embeds = w.hidden
    on = dict(**w.persistent, activations=earlier_layers + w.outer_act + embeds + w.hidden + sdpa_masks(w))
    retained, own = w.layer_gathers[layer - 1], w.layer_gathers[layer]
    return [
        moment(f"forward (layer {layer} all-gather)", **on,
               communication=w.root_gather + unsharded + retained + w.layer_all_gathers[layer]),
        moment(f"forward (layer {layer} all-gather copy-out)", **on,
               communication=w.root_gather + unsharded + retained + 2 * own + w.layer_copy_outs[layer]),
    ]


def sdpa_masks(w: FsdpTerms) -> int:
    """Under sdpa, the model forward's masks alive through its layer loop that no layer holds (qwen2_moe's
    sliding-window boolean mask, `moe_forward.model_mask_bytes`; the eager masks the layers keep are in their tables,
    `activations.eager_mask_held_saved`): 16,384 B of a checkpointed qwen2_moe cp 2 row (-0.26 % -> +0.015 %)."""
    from llmem.components.saved import _sdpa

    return moe_forward.model_mask_bytes(w.spec, w.cp) if _sdpa(w.spec, w.cp) else 0
