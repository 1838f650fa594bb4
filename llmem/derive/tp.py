"""Tensor parallelism with the model's own plan (`llmem.runtime.parallel.uses_hf_plan`): the per-rank inventory and
the traced program.

Inventory: each parameter's style in transformers' resolved plan (`PreTrainedModel._expand_parallel_plan` of the
model's `tp_plan`: the config's `base_model_tp_plan`, the causal LM's `lm_head: colwise_gather_output`, the
embeddings' `embedding_rowwise`), read on the meta device, and the split its style's `shard_param` gives the tensor
(transformers 5.23 `distributed/tensor_parallel.py`): Colwise and PackedColwise shard dim -2 of a weight (dim 0 of
a 2-D one, the expert's output features of a 3-D one) and a bias on dim 0; Rowwise and PackedRowwise a weight's
dim -1 and replicate the bias; `embedding_rowwise` shards the vocabulary (dim 0), `embedding_colwise` dim 1; every
other style (`replicated_with_grad_allreduce`, `moe_tp_experts`, ...) keeps the tensor whole.

Program: the traced tables (`llmem.derive.trace`) of a TP plan are traced on the wrapped model of rank 0 (the ceil
shard) under torch's fake process group (`fake_group`), as `llmem.simulate` runs it: DTensor's collectives give the
rank's local shapes, and every saved tensor and backward window is that rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses

from llmem.derive import cache
from llmem.spec import ModelSpec, TpSplit

COLWISE_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise", "embedding_rowwise")
ROWWISE_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise", "embedding_colwise")
GATHERED_STYLES = ("colwise_gather_output", "colwise_rep")  # the weight sharded by rows, the output all-gathered


def split(style: str | None, ndim: int) -> TpSplit:
    """The split a style gives one parameter (see the module docstring; `llmem.components.sharding.tp_local_shape`
    reads COLWISE as dim -2, or dim 0 of a 1-D tensor, and ROWWISE as dim -1; a rowwise bias stays whole)."""
    if style in COLWISE_STYLES:
        return TpSplit.COLWISE
    if style in ROWWISE_STYLES and ndim >= 2:
        return TpSplit.ROWWISE
    return TpSplit.NONE


def styles(config: dict) -> dict[str, str]:
    """Parameter name -> style of transformers' resolved TP plan, from the model built on the meta device; cached."""
    cached = cache.load(config, ("tp styles",))
    if cached is not None:
        return cached["styles"]
    import torch
    from transformers import AutoModelForCausalLM

    from llmem.plan import TrainingPlan
    from llmem.runtime.model import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config, TrainingPlan()), trust_remote_code=False)
    params = dict(model.named_parameters())
    expanded = model._expand_parallel_plan(dict(model.tp_plan))
    found = {name: style for name, style in expanded.items() if name in params}
    return cache.store(config, ("tp styles",), {"styles": found})["styles"]


def tp_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """A TP plan on a model whose TP program is transformers' plan (a derived architecture, or a hand-written family
    without the `tp_plan` trait, e.g. gpt_neox, phi3): the meta-device inventory with each parameter's split and
    the activation tables traced under TP (`llmem.derive.Derived`, keyed on the TP degree)."""
    config = getattr(spec, "source_config", None) or (spec.derived.config if spec.derived is not None else None)
    if tp == 1 or config is None:
        return spec
    return spec.memo(("tp_spec",), lambda: _tp_spec(spec, config))


def _tp_spec(spec: ModelSpec, config: dict) -> ModelSpec:
    from llmem.derive import derived_spec
    from llmem.derive.experts import TP_TRACED_MOE
    from llmem.errors import GAP, InputError

    try:  # mixtral's and qwen2_moe's experts are traced here as a derived MoE's (`experts.TP_TRACED_MOE`)
        base = spec if spec.derived is not None else derived_spec(config, TP_TRACED_MOE)
    except InputError as err:  # e.g. a MoE model type outside `experts.DERIVED_MOE`: its layers are not derived
        raise InputError("tp", f"tensor parallelism on {spec.model_type!r} runs the plan of its config, whose "
                         f"layers are traced from transformers, and {err}; use --tp 1", GAP) from None
    by_name = styles(config)
    params = tuple(dataclasses.replace(p, tp_split=split(by_name.get(p.name), len(p.shape)))
                   for p in base.params)
    # a hand-written family keeps its own expert widths, which the meta inventory does not carry (`_SIZES`) and its
    # MoE moments read (`components.moe_backward`: qwen2_moe's moe_intermediate_size, its shared expert's width)
    widths = {} if spec.derived is not None else {
        "moe_intermediate_size": spec.moe_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size}
    return dataclasses.replace(base, params=params, **widths)


def wrap_tp(model, tp: int, lora: bool = False):
    """The model wrapped by the runtime's TP (`llmem.runtime.parallel.wrap`) on `tp` ranks (`lora`: the base that
    PEFT then adapts, `llmem.runtime.lora_tp.distribute`); a plan transformers cannot apply to this model (a style
    its modules do not fit) is refused naming `tp`."""
    from llmem.errors import REFUSED, InputError
    from llmem.plan import TrainingPlan
    from llmem.runtime.lora_tp import distribute
    from llmem.runtime.parallel import wrap

    try:
        plan = TrainingPlan(gpus=tp, tp=tp, device="cpu")
        return distribute(model, plan, "cpu") if lora else wrap(model, plan)
    except Exception as e:  # noqa: BLE001 - transformers' styles raise their own errors on a module they do not fit
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise InputError("tp", f"transformers cannot apply this model's tensor-parallel plan ({first}); use --tp 1",
                         REFUSED) from None


@contextlib.contextmanager
def fake_group(tp: int):
    """Torch's fake process group of `tp` ranks as rank 0, with the device mesh built outside the fake mode
    (`llmem.simulate.patches.real_device_mesh`); a no-op when `tp` is 1."""
    if tp == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmem.simulate import patches

    if dist.is_initialized():
        from llmem.errors import InputError

        raise InputError("tp", "the TP trace runs its own fake process group; estimate outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        with patches.real_device_mesh():
            yield
    finally:
        dist.destroy_process_group()


def lora_target_refusal(spec: ModelSpec, plan) -> Exception | None:
    """LoRA + TP (`llmem.runtime.lora_tp`): PEFT's TP adapters run on a column-parallel target ("colwise"); a
    row-parallel one fails in its forward (`llmem.support_lora_tp.LORA_TP_ROWWISE`), and so does a gathered column-
    parallel one (`GATHERED_STYLES`, `llmem.support_lora_tp.LORA_TP_GATHERED`); any other style, or a Linear the
    plan leaves whole, is not measured."""
    from llmem.components.lora import targeted
    from llmem.errors import GAP, REFUSED, InputError
    from llmem.support_lora_tp import LORA_TP_GATHERED, LORA_TP_ROWWISE

    config = getattr(spec, "source_config", None) or (spec.derived.config if spec.derived is not None else None)
    by_name = styles(config) if config is not None else {}
    for p in targeted(spec, plan):
        style = by_name.get(p.name)
        if style in ROWWISE_STYLES:
            return InputError("lora-targets", f"{p.name.rsplit('.', 2)[-2]} is row-parallel ({style}): "
                              f"{LORA_TP_ROWWISE}; adapt only column-parallel Linears", REFUSED)
        if style in GATHERED_STYLES:
            plain = any(v == "colwise" for v in by_name.values())
            return InputError("lora-targets", f"{p.name.rsplit('.', 2)[-2]} is column-parallel with its output "
                              f"gathered ({style}): {LORA_TP_GATHERED}; " + (
                                  "adapt only column-parallel Linears" if plain else
                                  f"{spec.model_type}'s TP plan has no other column-parallel Linear: use --tp 1"),
                              REFUSED)
        if style != "colwise":
            what = f"style {style!r}" if style else "no TP style (kept whole)"
            return InputError("lora-targets", f"{p.name.rsplit('.', 2)[-2]} has {what} in {spec.model_type}'s TP plan: "
                              "LoRA on it under TP is not measured (PEFT hooks colwise and rowwise Linears only); "
                              "adapt only column-parallel Linears, or use --tp 1", GAP)
    return None
