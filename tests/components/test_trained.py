"""The tensors the optimizer gets (`llmem.components.trained.trained_tensors`), against the model the runtime builds
for the plan on the meta device: the parameters with `requires_grad` in `model.parameters()` order (what
`llmem.runtime.optim` hands the optimizer), their sizes and bytes per element — for full fine-tuning, LoRA and LoRA
with module copies alike (the oracle is PyTorch's own flags on the transformers / PEFT model)."""

from __future__ import annotations

import pytest

from llmem.components.trained import trained_tensors
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_trainable import CASES, _model_on_meta

pytest.importorskip("peft")
# OPT registers project_in/out and its final norm before the layers (`model_order` keeps the tensors, not that order)
UNORDERED = {"opt"}


@pytest.mark.parametrize("name, cfg, fields", CASES, ids=[c[0] for c in CASES])
def test_the_optimizer_gets_the_tensors_that_require_grad(name, cfg, fields):
    plan = TrainingPlan(seq_len=16, **fields)
    model = _model_on_meta(cfg, plan)
    built = [(p.numel(), p.element_size()) for p in model.parameters() if p.requires_grad]
    items = trained_tensors(ModelSpec.from_config(cfg), plan)
    ours = list(zip(items.numel, items.elem_bytes, strict=True))
    assert (sorted(ours) == sorted(built)) if name in UNORDERED else (ours == built)
