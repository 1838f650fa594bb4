"""QLoRA with an 8-bit base on the traced architectures (`llmem.derive.int8`): the inputs bitsandbytes'
`MatMul8bitFp` nodes keep as `ctx.A` (no pack hook sees them) against the real program's nodes, and the estimate
against a real CPU run within 1 % (a grid of families x fp32/bf16/fp16 x checkpointing x one rank / DDP with
`-m heavy`)."""

from __future__ import annotations

import pytest

from llmem.components import quant_int8_traced
from llmem.components.lora_activations import traced_spec
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.derive import test_qlora_traced as qlora_traced
from tests.derive.test_lora_derived import config_of
from tests.derive.test_qlora_traced import WIDE, grid_case, row_config

TOLERANCE = 0.01
_BASE = dict(method="qlora", quant="int8", lora_targets="all-linear", batch_size=2, seq_len=64, device="cpu")


def _real_held_bytes(cfg: dict, plan: TrainingPlan) -> int:
    """One forward of the real quantized PEFT model (`llmem.runtime`): the distinct storages the `MatMul8bitFp`
    nodes reachable from the logits keep as `ctx.A` (bitsandbytes 0.50.2 `autograd/_functions.py`)."""
    import torch

    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model
    from llmem.runtime.session import enable_checkpointing

    torch.manual_seed(0)
    model = build_model(cfg, plan)
    if plan.checkpointed(0):
        enable_checkpointing(model, plan)
    model = apply_method(model, plan)
    logits = model(input_ids=torch.zeros((plan.batch_size, plan.seq_len), dtype=torch.long)).logits
    seen, stack, storages = set(), [logits.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "MatMul8bitFpBackward":
            storages[node.A.untyped_storage().data_ptr()] = node.A.untyped_storage().nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return sum(storages.values())


@pytest.mark.parametrize("family, plan", [("opt", dict(precision="bf16"))])
def test_held_inputs_equal_the_real_nodes(family, plan):
    """The traced held inputs (`quant_int8_traced.all_bytes`: every decoder layer's and opt's project_out's) against
    the real model's 8-bit nodes after one forward: the same bytes."""
    p = TrainingPlan(**{**_BASE, **plan})
    spec = traced_spec(ModelSpec.from_config(config_of(family)), p)
    assert quant_int8_traced.all_bytes(spec, p) == _real_held_bytes(config_of(family), p) > 0


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["gpt_neox", "phi", "starcoder2", "stablelm"])
def test_held_inputs_equal_the_real_nodes_checkpointed(family):
    """With --grad-ckpt full: transformers' input-require-grads hook makes layer 0's inputs need a gradient."""
    p = TrainingPlan(**{**_BASE, "precision": "bf16", "grad_ckpt": "full"})
    spec = traced_spec(ModelSpec.from_config(config_of(family)), p)
    assert quant_int8_traced.all_bytes(spec, p) == _real_held_bytes(config_of(family), p) > 0


def _error(cfg: dict, **plan) -> float:
    return qlora_traced._error(cfg, _BASE, **plan)


FAMILIES = ("gpt_neox", "falcon", "phi", "opt", "starcoder2", "stablelm")
GRID = {f"{f}-{prec}-{ckpt}": (f, dict(precision=prec, grad_ckpt=ckpt))
        for f in FAMILIES for prec in ("fp32", "bf16") for ckpt in ("none", "full")}
GRID.update({f"wide-{f}": (f, dict(wide=True)) for f in WIDE})
GRID.update({"phi-fp16": ("phi", dict(precision="fp16")),
             "gpt_neox-fp16-full": ("gpt_neox", dict(precision="fp16", grad_ckpt="full"))})


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(GRID))
def test_traced_int8_qlora_grid(name):
    cfg, plan = grid_case(*GRID[name])
    assert abs(_error(cfg, **plan)) <= TOLERANCE


TWO = TwoRankRows(dict(_BASE, gpus=2, zero=0, precision="fp32"), {
    "gpt_neox": dict(),
    "stablelm-ckpt-bf16": dict(grad_ckpt="full", precision="bf16"),
    "phi-wide": dict(),
}, row_config, sampled=())


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(TWO.rows))
def test_traced_int8_qlora_ddp(name):
    TWO.check(name, TOLERANCE)
