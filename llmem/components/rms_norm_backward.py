"""A decoder layer's two RMSNorms' backward: moments after its MLP's backward and after its attention's.

A llama-like decoder layer (transformers 5.23 `models/llama/modeling_llama.py` `LlamaDecoderLayer.forward`:
`hidden = residual + self_attn(input_layernorm(x))`, then `hidden = hidden + mlp(post_attention_layernorm(hidden))`)
runs backward in the reverse order of its graph: the MLP's nodes, `post_attention_layernorm`'s, the attention's,
`input_layernorm`'s. When the nodes after a norm have run (the MLP's last, gate_proj's `MmBackward0` with its input
gradient summed with up_proj's; the attention's last, q_proj's, summed with k's and v's), every tensor they saved is
released (`Node::release_variables`), the norm's output they saved with it, and their weight gradients exist; the
gradient of the residual stream waits in the residual branch's input buffer (summed with the norm's input gradient
last). The norm then runs its own backward in fp32 (`hidden.to(float32)`; `pow`, `mean`, `rsqrt` and two `mul`s):
five tokens × h fp32 tensors at once at `pow_backward` beside its output gradient. With a narrow MLP or few heads
(b·s·i half or the attention's gradients below that) this is above the layer's other backward moments.

Each norm is the same module class as the final norm (`LlamaRMSNorm`, `MistralRMSNorm`, `Qwen2RMSNorm`,
`Qwen3RMSNorm`, `GemmaRMSNorm`, `Phi3RMSNorm`), so its backward is the final norm's traced curve
(`llmem.components.final_norm.backward_bytes`: its output gradient only the engine holds, its temporaries, its
input and weight gradients, less its own saved tensors once released). Modelled for the hand-written llama-like
dense tables (`layer_tables.llama_family_saved`) in full fine-tuning without autocast (FSDP2's compute plan), and
under LoRA in the FSDP2 walk (`applies_lora`: frozen norms, the final norm's frozen curve, the LoRA table and the
adapters' gradients); not MoE, not gemma2's sandwich norms (`norm_backward`), not float8, TP or context parallelism
(a cp rank's walk is its local plan's, cp 1).
"""

from __future__ import annotations

from llmem.components import autocast, lora
from llmem.components import final_norm as fnorm
from llmem.components.layer_tables import _TABLES
from llmem.components.sharding import local_numel
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

PRE_MLP, INPUT = "post_attention_layernorm", "input_layernorm"


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """A hand-written llama-like dense layer (not gemma2's sandwich norms), full fine-tuning, no autocast, one rank's
    whole sequence and TP 1 (`plan`: the walk's compute plan)."""
    family = spec.family
    return (spec.derived is None and spec.model_type not in _TABLES and not family.sandwich_norms
            and not family.grouped_experts and not lora.is_lora(plan) and not autocast.applies(plan)
            and plan.tp == 1 and plan.cp == 1 and plan.float8.value == "none")


def _own(name: str, norm: str) -> bool:
    """A tensor the norm saved for its own backward (not its output, which the Linears after it saved)."""
    return name.startswith(f"{norm}.") and name != f"{norm}.output"


def released_bytes(items: tuple, norm: str) -> int:
    """Of the layer's saved tensors (`activations.layer_saved`), those released when `norm`'s backward starts: the
    MLP's and the pre-MLP norm's output (`PRE_MLP`); every one but the input norm's own and, fp32, its input, the
    residual stream (`INPUT`)."""
    if norm == PRE_MLP:
        mlp = ("gate_proj", "silu(gate)", "up_proj", "silu(gate) * up", "gate_up_proj output", "resid_mlp_dropout")
        return sum(s.bytes for s in items if s.name.startswith(mlp) or s.name == f"{PRE_MLP}.output")
    return sum(s.bytes for s in items if not _own(s.name, INPUT) and s.name != "input (residual stream)")


def weight_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, norm: str) -> int:
    """The layer's weight (and bias) gradients made before `norm`'s backward, in the parameter dtype: the MLP's
    (`PRE_MLP`); every one but the input norm's (`INPUT`)."""
    made = [p for p in spec.layer_params(0)
            if (".mlp." in p.name if norm == PRE_MLP else f".{INPUT}." not in p.name)]
    return sum(local_numel(p, plan) for p in made) * plan.precision.param_bytes


def backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """A norm's backward above its start: the final norm's traced curve (the same module class)."""
    return fnorm.backward_bytes(spec, plan)


# --- LoRA (hand-written dense tables, FSDP2's compute plan): the frozen norms still make their input's gradient ----
_LORA_MLP = ("gate_proj", "silu(gate)", "up_proj", "down_proj")  # the MLP's entries and its adapters'


def applies_lora(spec: ModelSpec, plan: TrainingPlan, layer: int) -> bool:
    """LoRA (not QLoRA) on the llama-like dense tables, as `applies` otherwise. The norms are frozen: no weight
    gradient, and the final norm's frozen curve (`final_norm.curve`). Layer 0 only where its input requires grad
    (`lora_activations.layer0_input_requires_grad`): otherwise neither of its norms has a node to run (the input
    norm's input needs no grad; the pre-MLP norm's only when an attention Linear is adapted, not walked)."""
    from llmem.components.lora_activations import layer0_input_requires_grad
    from llmem.plan import Method

    family = spec.family
    return (plan.method is Method.LORA and spec.derived is None and spec.model_type not in _TABLES
            and family.tp_plan and not family.sandwich_norms and not autocast.applies(plan) and plan.tp == 1
            and plan.cp == 1 and plan.float8.value == "none"
            and (layer > 0 or layer0_input_requires_grad(spec, plan)))


def lora_released_bytes(items: tuple, norm: str) -> int:
    """`released_bytes` on a LoRA table (`lora_activations.layer_saved`): before the pre-MLP norm's backward the
    MLP's entries and its adapters' (`_LORA_MLP`); before the input norm's every entry but its rsqrt and input."""
    if norm == PRE_MLP:
        return sum(s.bytes for s in items if s.name.startswith(_LORA_MLP))
    return sum(s.bytes for s in items if not _own(s.name, INPUT) and s.name != "input (residual stream)")


def lora_gradient_bytes(spec: ModelSpec, plan: TrainingPlan, norm: str, elem: int) -> int:
    """The adapters' gradients made before `norm`'s backward (`elem` bytes each): the MLP's adapters (`PRE_MLP`),
    every adapter of the layer (`INPUT`)."""
    made = [p for p in lora.layer0_targeted(spec, plan) if norm == INPUT or ".mlp." in p.name]
    return sum(plan.lora_rank * sum(lora.in_out(spec, p)) for p in made) * elem
