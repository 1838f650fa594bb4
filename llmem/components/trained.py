"""The tensors the optimizer gets, one entry each, in the order it walks them: the trainable inventory
(`llmem.components.trainable`) as the optimizer sees it. The method substitutes here, once; the optimizer's states
and step temporaries (`llmem.components.optimizer`) read this list whatever the method.

The runtime hands the optimizer the parameters with `requires_grad` in `model.parameters()` order
(`llmem.runtime.optim`). Full fine-tuning: every parameter, in the plan's parameter dtype, as the scheme shards it.
LoRA and QLoRA: PEFT's fp32 adapters (`LoraLayer.update_layer`, `llmem.components.lora`; FSDP2 shards them with
their layer, TP shards lora_B of a column-parallel Linear and lora_A of a row-parallel one), and the trainable copies
of `--lora-modules-to-save` in the parameter dtype, the embedding's registered before the layers, the lm_head's after
(`peft/utils/other.py: ModulesToSaveWrapper`); the frozen (or quantized) base gets no state.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

from llmem.components import lora
from llmem.components.sharding import FSDP_SCHEMES, fsdp_shard_numel, shard_summary, tp_local_shape
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, TpSplit, per_spec


class Trained(NamedTuple):
    """The tensors the optimizer updates, column by column (entry k of each column is tensor k's): a 70B model's
    ~700 tensors per layout are sizes in tuples, not objects."""

    numel: tuple[int, ...]  # elements on this rank (TP and FSDP2: the shard)
    shape: tuple[tuple[int, ...], ...]  # shape on this rank under TP (before FSDP2's flat sharding)
    elem_bytes: tuple[int, ...]  # bytes per element: of the tensor, its gradient and its optimizer states
    dtensor: tuple[bool, ...]  # under TP, a DTensor parameter (`llmem.runtime.optim.param_groups`: its own group)

    def select(self, index) -> Trained:
        """The tensors at `index`, in that order."""
        return Trained(*(tuple(column[k] for k in index) for column in self))


@per_spec("layout_key")
def trained_tensors(spec: ModelSpec, plan: TrainingPlan) -> Trained:
    """Every tensor the plan trains on this rank (before ZeRO-1 partitions them or an offload moves them)."""
    return _adapters(spec, plan) if lora.is_lora(plan) else _full(spec, plan)


def _full(spec: ModelSpec, plan: TrainingPlan) -> Trained:
    """Every parameter, in `model.parameters()` order, in the parameter dtype; under TP a DTensor when its Linear is
    split (a row-wise Linear's bias too: replicated, but a DTensor of its module)."""
    numel = _in_model_order(spec)(shard_summary(spec, plan).sizes)
    shapes, dtensor = spec.memo(("trained.full", plan.tp), lambda: _full_columns(spec, plan.tp))
    return Trained(numel, shapes, (plan.precision.param_bytes,) * len(numel), dtensor)


def _full_columns(spec: ModelSpec, tp: int) -> tuple[tuple, tuple]:
    row_split = {p.name.removesuffix(".weight") for p in spec.params if p.tp_split is TpSplit.ROWWISE}
    order = model_order(spec)
    return (tuple(tp_local_shape(p, tp) for p in order),
            tuple(p.tp_split is not TpSplit.NONE or p.name.removesuffix(".bias") in row_split for p in order))


def _adapters(spec: ModelSpec, plan: TrainingPlan) -> Trained:
    """The embedding's trainable copy, the adapters layer by layer, the lm_head's copy (copies: one rank, no TP)."""
    pb, fsdp = plan.precision.param_bytes, plan.scheme in FSDP_SCHEMES
    copies = lora.module_copies(spec, plan)
    heads = [c.name.removesuffix(".modules_to_save.default.weight").endswith(lora._HEADS) for c in copies]
    copy_numel = (lambda c: fsdp_shard_numel(c.shape, plan)) if fsdp else (lambda c: c.numel)  # a root parameter
    rows = [(copy_numel(c), c.shape, pb, False) for c, h in zip(copies, heads, strict=True) if not h]
    for a in lora.adapter_params(spec, plan):
        shape = tp_local_shape(a, plan.tp)
        numel = fsdp_shard_numel(a.shape, plan) if fsdp else math.prod(shape)
        rows.append((numel, shape, lora.adapter_elem_bytes(spec), a.tp_split is not TpSplit.NONE))
    rows += [(copy_numel(c), c.shape, pb, False) for c, h in zip(copies, heads, strict=True) if h]
    return Trained(*(tuple(column) for column in zip(*rows, strict=True))) if rows else Trained((), (), (), ())


_EMBEDDING_NAMES = ("emb", "wte", "wpe")


def _in_model_order(spec: ModelSpec):
    """A function of a tuple in spec order to the tuple in `model_order` (one C call per layout)."""
    def build():
        index = _model_order_index(spec)
        return (lambda values: ()) if not index else (lambda values: (values[index[0]],)) if len(index) == 1 \
            else operator.itemgetter(*index)

    return spec.memo(("in_model_order",), build)


def _model_order_index(spec: ModelSpec) -> list[int]:
    """Positions in `spec.params` of the tensors in `model_order`."""
    def build() -> list[int]:
        index = {id(p): i for i, p in enumerate(spec.params)}
        return [index[id(p)] for p in model_order(spec)]

    return spec.memo(("model_order_index",), build)


def model_order(spec: ModelSpec) -> list[ParamTensor]:
    """`model.parameters()` order as transformers registers modules: the embedding tables first, then the decoder
    layers, then the final norm and the output head (spec order keeps the layers first). Checked against the
    models on the meta device for llama, gpt2 and falcon; a family registering other modules before its layers
    (OPT's project_in/out, final norm) only moves small tensors in the for-loop walk."""
    outer = [p for p in spec.params if p.layer is None]
    first = [p for p in outer if any(e in p.name.rsplit(".", 2)[-2] for e in _EMBEDDING_NAMES)]
    rest = [p for p in outer if p not in first]
    return first + [p for p in spec.params if p.layer is not None] + rest
