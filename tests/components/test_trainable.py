"""The method's inventory (`llmem.components.trainable`) against the model the runtime builds for the plan, on the
meta device: which tensors require grad, their bytes, where they sit (a decoder layer, outside), and the base.

The oracle is PyTorch's own flags on the real transformers / PEFT model (`requires_grad`, dtype, shared storage of
tied weights), not the estimator's tables: a term that counted a frozen tensor, missed an adapter or a module copy,
or took the wrong dtype fails here before any measured test."""

from __future__ import annotations

import re

import pytest

from llmem.components.trainable import trainable
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS

TIED = dict(CONFIGS["llama"], tie_word_embeddings=True)
CASES = [
    ("llama", CONFIGS["llama"], {}), ("llama-bf16", CONFIGS["llama"], {"precision": "bf16"}),
    ("tied-llama", TIED, {"precision": "bf16-mixed"}), ("gpt2", CONFIGS["gpt2"], {}),
    ("opt", CONFIGS["opt"], {"precision": "bf16"}),
    ("llama-lora", CONFIGS["llama"], {"method": "lora", "lora_targets": "q_proj,v_proj"}),
    ("llama-lora-copies", CONFIGS["llama"],
     {"method": "lora", "lora_targets": "all-linear", "lora_modules_to_save": "lm_head,embed_tokens"}),
    ("tied-lora", TIED, {"method": "lora", "lora_targets": "all-linear", "precision": "bf16"}),
    ("gpt2-lora", CONFIGS["gpt2"], {"method": "lora", "lora_targets": "c_attn"}),
]
def _model_on_meta(cfg: dict, plan: TrainingPlan):
    """The model the runtime trains for `plan` (`build_model`: the plan's parameter dtype; `apply_method`: PEFT)."""
    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model

    return apply_method(build_model(cfg, plan, device="meta"), plan)


_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def _inventory(model) -> dict:
    """Bytes of the trained tensors in total, per decoder layer and outside the layers; all parameters' bytes; and
    whether a trained tensor is shared (a tied weight: one storage, two names)."""
    seen, inv = set(), {"trained": 0, "layers": {}, "outside": 0, "all": 0, "shared": 0, "embedding": False}
    for name, p in model.named_parameters(remove_duplicate=False):
        nbytes = p.numel() * p.element_size()
        if id(p) in seen:  # the second name of a tied weight
            inv["shared"] += nbytes if p.requires_grad else 0
            continue
        seen.add(id(p))
        inv["all"] += nbytes
        if not p.requires_grad:
            continue
        inv["trained"] += nbytes
        inv["embedding"] |= "embed_tokens" in name or ".wte." in name
        if (m := _LAYER.search(name)) is not None:
            inv["layers"][int(m.group(1))] = inv["layers"].get(int(m.group(1)), 0) + nbytes
        else:
            inv["outside"] += nbytes
    return inv


@pytest.mark.parametrize("name,cfg,fields", CASES, ids=[c[0] for c in CASES])
def test_inventory_matches_the_model_the_runtime_builds(name, cfg, fields):
    plan = TrainingPlan(**fields)
    real = _inventory(_model_on_meta(cfg, plan))
    t = trainable(ModelSpec.from_config(cfg), plan)
    assert t.gradients == real["trained"]
    assert t.base + t.adapters == real["all"]
    assert list(t.layer) == [real["layers"].get(k, 0) for k in range(len(t.layer))]
    assert list(t.later) == [sum(t.layer[k + 1:]) for k in range(len(t.layer))]
    assert t.shared == real["shared"]
    # outside the layers: the head's `.grad`s (a tied weight's among them), the position embeddings', and the
    # input embedding's when it is a tensor of its own
    assert t.head + t.positional + (0 if t.shared else t.embedding) == real["outside"]
    assert t.embedding_backward == (real["embedding"] or plan.method.value == "full")
