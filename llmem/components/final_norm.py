"""The final norm's backward: after the lm_head's, before the last decoder layer's.

Every forward activation is still alive then, less what the lm_head (and OPT's project_out) saved of the norm's
output (their nodes have run, `Node::release_variables`); the norm's output gradient (the lm_head's input gradient)
exists, and the norm's autograd graph makes its temporaries: `LlamaRMSNorm` (transformers 5.23
`models/llama/modeling_llama.py` lines 52-66) `pow`, `mean`, `rsqrt`, two `mul`s and, in half precision, the fp32
upcast; `nn.LayerNorm` (GPT-2's `ln_f`, `models/gpt2/modeling_gpt2.py` lines 495, 617) `native_layer_norm_backward`'s
input and weight gradients. With a real vocabulary the loss's fp32 logits gradient is larger; with a tiny one (V ≈ h)
or no logits (fused CE) this moment can be the peak.

The bytes are not written by hand: `llmem.derive.final_norm` traces the model's own final norm on fake tensors
(forward, then backward from a gradient only the engine holds, in the allocation tracker) and solves each event's
live bytes as a · tokens · h + b · tokens + c · h + d. The hand-written families' curves are generated into
`llmem.components.final_norm_table` (torch-free); a derived architecture's are traced on first use (cached on disk).
"""

from __future__ import annotations

import re

from llmem.components import autocast, lora
from llmem.components.final_norm_table import CURVES
from llmem.plan import Precision, TrainingPlan
from llmem.spec import ModelSpec, per_spec

AFTER_NORM = ("lm_head", "project_out")  # the saved tensors of the modules after the norm (hand tables and traces)
# A traced entry is named "<module>: <op> <dtype>" after the innermost module saving it (`llmem.derive.trace`); in a
# PEFT model's trace that module sits under "base_model.model." (PEFT 0.21.2 `peft_model.py:177`,
# `self.base_model`; `tuners/tuners_utils.py:322`, `self.model`) and a trained copy under ".modules_to_save.default"
# (`utils/other.py:609`): a dotted component of the module path names the module after the norm.
_AFTER_NORM_MODULE = re.compile(r"(^|\.)(" + "|".join(AFTER_NORM) + r")\b")


def kind(plan: TrainingPlan) -> str:
    """The precision the norm runs in: fp32; "mixed" under autocast (fp32 residual stream); else "half" (pure half,
    and FSDP's mixed-precision policies, whose parameters are half in compute)."""
    if plan.precision is Precision.FP32:
        return "fp32"
    return "mixed" if autocast.applies(plan) else "half"


def curve(spec: ModelSpec, plan: TrainingPlan) -> tuple:
    """The traced events (a, b, c, d) of the spec's final norm under `plan` (frozen under LoRA: no weight gradient)."""
    key = (kind(plan), lora.is_lora(plan))
    if spec.derived is not None:
        from llmem.derive.final_norm import cached_curve

        return cached_curve(spec.derived.config, *key)
    return CURVES.get((spec.family.model_type, *key), ())


@per_spec()
def backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The largest live bytes of the final norm's backward above its start: its output gradient, its temporaries,
    its input and weight gradients, less its own saved tensors once released. Tokens on this rank."""
    tokens, h = plan.batch_size * plan.seq_len, spec.hidden_size
    return max((a * tokens * h + b * tokens + c * h + d for a, b, c, d in curve(spec, plan)), default=0)


def after_norm_saved_bytes(spec: ModelSpec, plan: TrainingPlan, saved: list | None = None) -> int:
    """What the lm_head (and project_out) saved of the norm's output, released before the norm's backward; `saved`:
    the final norm's saved list the walk counted (default `activations.final_norm_saved`)."""
    if saved is None:
        from llmem.components.activations import final_norm_saved

        saved = final_norm_saved(spec, plan)
    return sum(s.bytes for s in saved if _AFTER_NORM_MODULE.search(s.name.split(": ", 1)[0]))
