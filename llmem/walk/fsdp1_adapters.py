"""The walk of LoRA under FSDP1 wrapped as the FSDP-LoRA recipes wrap it (`--engine fsdp1 --fsdp1-wrap adapters`,
`llmem.components.flat_adapters`): the FSDP2 walk's LoRA compute (a frozen base whose views require no grad) with
FSDP1's flat buffers (`llmem.walk.fsdp1`: the root gathered through forward and backward, a layer's flat parameter
gathered at its pre-forward and its backward). In order:
  forward     the root's all-gather, each layer's (`fsdp1.forward_moments`); an adapter unit's gather inside its
              layer's forward is r·(in + out) elements, small beside the layer's.
  head        the loss, the root's pre-backward prefetch of the last layer (`fsdp1.head_moments`).
  layer       the layer's backward moments (`fsdp_layer._backward_moments`, the gradients of the layers above it
              their adapter units' shards); then the pre-backward of its first adapter (q_proj's, the first of the
              layer's units to finish forward) prefetches the layer below (torch 2.13
              `fsdp/_exec_order_utils.py:88`): its all-gather beside the layer's, with what the layer still holds
              then (`prefetch_moment`). The frozen layer reshards once its input's gradient is made.
  end         no root gradient (frozen): the adapter shards and the optimizer step.
"""

from __future__ import annotations

from dataclasses import fields

from llmem.components import activations as act
from llmem.components import flat_adapters as fa
from llmem.components import flat_param as fp
from llmem.components import lora, quant
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import buffer_bytes
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.fsdp import FsdpTerms, fsdp_terms
from llmem.walk.fsdp1 import Fsdp1Terms, _gathered, _zero2, forward_moments, head_moments
from llmem.walk.fsdp1_qlora import flat_qlora_moments
from llmem.walk.fsdp_layer import _backward_moments, _kept
from llmem.walk.phase import Phase, moment


def adapters_terms(spec: ModelSpec, plan: TrainingPlan) -> Fsdp1Terms:
    """The FSDP2 walk's LoRA terms (the base's views require no grad: LoRA's table, layer 0's saving) with FSDP1's
    persistent bytes: every unit's shard, the buffers (cast under MixedPrecision) and the states over the adapter
    units' shards."""
    w = fsdp_terms(spec, plan)
    cast = plan.precision.compute_bytes if plan.precision.is_mixed else None
    codes = quant.quant_state_bytes(spec, plan) if quant.is_qlora(plan) else 0  # QLoRA: whole on every rank
    persistent = dict(parameters=sum(fp.shard_bytes(spec, plan)) + codes + buffer_bytes(spec, plan, cast),
                      optimizer=optimizer_state_bytes(spec, plan))
    values = {f.name: getattr(w, f.name) for f in fields(FsdpTerms)} | {"persistent": persistent}
    return Fsdp1Terms(**values, flat=plan, frozen_root=True)


def first_adapter_saved_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> int:
    """What the layer's first adapter (q_proj's, or k_proj's, v_proj's: the attention group reads the input norm's
    output) still keeps at its pre-backward: its dropout's saves and output, one of the group's `n` shares
    (`lora_activations._adapter_input_saved`); with dropout 0 the group's one saved input."""
    group = [p for p in lora.layer0_targeted(spec, plan) if p.name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    saved = [s for s in lora.layer_saved(spec, cp) if "lora_dropout" in s.name or "lora_A input" in s.name
             or "input kept by lora_A" in s.name]
    saved = [s for s in saved if s.name.split(":")[0].split(" ")[0] == "q_proj/k_proj/v_proj"]
    total = sum(s.bytes for s in saved)
    return total // len(group) if plan.lora_dropout and group else total


def prefetch_moment(w: Fsdp1Terms, layer: int, later: int) -> Phase:
    """The first adapter's pre-backward prefetch of layer - 1 (FULL_SHARD): the layers below and the outer saves,
    of the layer's own only the input norm's (its input, rsqrt) and the first adapter's (`first_adapter_saved_bytes`);
    the gradients: the layer output's (the residual), the layer input's being summed over q/k/v, q_proj's output's
    (waiting for the base Linear's backward), lora_A's output's (tokens · r), the layer's adapter shards made; the
    two layers gathered, layer - 1's gather transients and the first adapter's unsharded parameter."""
    spec, plan, cp = w.spec, w.plan, w.cp
    below, _ = _kept(w, layer)
    tokens, cb = plan.batch_size * plan.seq_len, cp.precision.compute_bytes
    norm = sum(s.bytes for s in lora.layer_saved(spec, cp) if s.name in ("input (residual stream)",)
               or s.name.startswith("input_layernorm"))
    own = norm + first_adapter_saved_bytes(spec, plan, cp)
    grads = w.residual_grad + tokens * (spec.hidden_size + spec.num_heads * spec.head_dim
                                        + plan.lora_rank) * cb
    first = fa.layer_adapter_units(spec, plan, layer)[:1]  # the first adapter itself, prefetched by the one after it
    gathered = _gathered(w, (layer - 1, layer)) + fp.gather_transient_bytes(spec, plan, layer) + sum(
        fp.unsharded_bytes(spec, plan)[u] for u in first)
    return moment(f"backward (layer {layer}, prefetch of layer {layer - 1})", **w.persistent, logits=w.logits,
                  activations=below + w.outer_act + own - w.first_saving, communication=gathered,
                  gradients=later + fa.layer_grad_shard_bytes(spec, plan, layer) + grads)


def layer_moments(w: Fsdp1Terms, layer: int, later: int) -> list[Phase]:
    """The layer's backward moments with the root and the layer gathered (SHARD_GRAD_OP: every layer up to it),
    then, FULL_SHARD above layer 0, the prefetch of the layer below."""
    below, _ = _kept(w, layer)
    gathered = _gathered(w, range(layer + 1) if _zero2(w) else (layer,))
    phases = _backward_moments(w, layer, later, 0, {}, below, gathered)
    if layer and not _zero2(w) and fp.sharded(w.plan):
        phases.append(prefetch_moment(w, layer, later))
    return phases


def end_moments(w: Fsdp1Terms) -> list[Phase]:
    """The end of backward (the root and layer 0 gathered until the final callback reshards them: no gradient
    reaches their inputs) and the optimizer step over the adapter units' shards."""
    spec, plan = w.spec, w.plan
    grads = sum(fa.layer_grad_shard_bytes(spec, plan, layer) for layer in range(spec.num_layers))
    on = dict(**w.persistent, logits=w.logits, gradients=grads)
    return [moment("backward end", **on, communication=_gathered(w, (0,))),
            moment("optimizer step", **on, temporaries=optimizer_step_temporary_bytes(spec, plan))]


def adapters_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """`--fsdp1-wrap adapters`: the candidate peak moments of one steady-state iteration."""
    w = adapters_terms(spec, plan)
    phases = forward_moments(w) + head_moments(w)
    shards = [fa.layer_grad_shard_bytes(spec, plan, layer) for layer in range(spec.num_layers)]
    for layer in act.backward_layers(spec, w.cp, edge=2):
        phases += layer_moments(w, layer, sum(shards[layer + 1:]))
    # QLoRA: a 4-bit weight dequantized in the last layer's forward and in each backward moment (not between ops)
    phases += flat_qlora_moments(w, [ph for ph in phases if "prefetch of" not in ph.name], {})
    return phases + end_moments(w)
