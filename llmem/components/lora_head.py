"""LoRA on the output layer (`--lora-targets ...,lm_head`): PEFT's `lora.Linear` around the frozen lm_head.

What runs (peft 0.21.2): a target named `lm_head` (the output layer's module name, `head_module`: `lm_head` in every
family, GPT-NeoX included since transformers 5) is wrapped like any Linear (`all-linear` leaves it out; a named
target does not). A target naming another model's head (`embed_out`, transformers 4's GPT-NeoX name) matches
nothing here, and PEFT ignores it silently when another target matches: refused with the right name
(`check_name`). With tied embeddings PEFT adapts the lm_head
module and leaves the shared weight frozen (it warns that the adapters are not tied): the same program.
  lora_A: Linear(h, r) -> weight (r, h);  lora_B: Linear(r, V) -> weight (V, r)   (fp32, like every adapter)
Forward (`peft/tuners/lora/layer.py: Linear.forward`, 0.21.2):
  result = base_layer(x)                                  # the logits, T × V
  result = result + lora_B(lora_A(dropout(x))) * scaling  # out of place
so, with T tokens and V the vocabulary, three T × V tensors are alive at the add: the base logits, the scaled
adapter output and the sum (lora_B's own output is freed once `* scaling` returned; the add and the scalar mul save
nothing). In fp32 (adapter dtype = logits dtype) each is T × V × 4.
Saved for backward: lora_A's input (x itself when dropout is 0: the final norm output, which the frozen head does
not save otherwise; with dropout > 0 the dropout output and its noise, `activations.dropout_saved`), and lora_B's
input, the T × r A output.
Backward: the logits' gradient reaches the add, which passes it on unchanged; `MulBackward0` makes a T × V
`grad * scaling` for lora_B's `MmBackward0`, which makes the (V, r) weight gradient and the T × r input gradient.
Under autocast (bf16-/fp16-mixed) the add's three tensors are half, and lora_A saves its half input copy, lora_B its
half input, mm both adapters' half weight casts (`saved_bytes`).
Modelled and measured: `--method lora` on one device or DDP, fp32 or bf16-mixed (`llmem.support_lora_head`).
"""

from __future__ import annotations

from llmem.plan import ALL_LINEAR, Method, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor

FP32 = 4
HEADS = ("lm_head", "embed_out")


def targets_head(plan: TrainingPlan) -> bool:
    """Whether the plan names the output layer among its LoRA targets."""
    if plan.method not in (Method.LORA, Method.QLORA) or plan.lora_targets == ALL_LINEAR:
        return False
    return any(t.rsplit(".", 1)[-1] in HEADS for t in plan.lora_targets.split(","))


def head_module(spec: ModelSpec) -> str:
    """The output layer's module name: the untied head weight's, else the family's `output_layer` (the tied head is
    a module of its own whose weight is the embedding's: `lm_head`, `modeling_gpt_neox.py:377,385`), or for a traced
    architecture the name of the module its model's `get_output_embeddings()` returns (`llmem.derive.head`)."""
    for p in spec.outer_params:
        m = p.name.removesuffix(".weight")
        if m.rsplit(".", 1)[-1] in HEADS:
            return m
    return spec.derived.output_layer() if spec.derived is not None else spec.family.output_layer


def check_name(spec: ModelSpec, target: str, option: str = "lora-targets") -> None:
    """A head name (`lm_head`, `embed_out`) that is not this model's output layer matches no module: PEFT 0.21.2
    skips it without a word when another target matches (`tuners_utils.py:1093-1102`), so the run has no such
    adapter. Refused with the model's own name."""
    from llmem.errors import InputError

    head = head_module(spec).rsplit(".", 1)[-1]
    if target.rsplit(".", 1)[-1] != head:
        raise InputError(option, f"{target!r} matches no module of {spec.model_type} in transformers 5.23: its output "
                         f"layer is {head} (GPT-NeoX checkpoints' embed_out is renamed lm_head on load); write {head}")


def adapter_params(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """lora_A (r, h) and lora_B (V, r) of the output layer (outside the decoder layers), or none."""
    if not targets_head(plan):
        return []
    from llmem.components.activations import _proj_dim

    m, r = head_module(spec), plan.lora_rank
    return [ParamTensor(f"{m}.lora_A.default.weight", (r, _proj_dim(spec)), None),
            ParamTensor(f"{m}.lora_B.default.weight", (spec.vocab_size, r), None)]


def _tokens(plan: TrainingPlan) -> int:
    return plan.batch_size * plan.seq_len


def _half(plan: TrainingPlan) -> int:
    """Bytes of the adapters' compute dtype: 2 under autocast (bf16-/fp16-mixed), else 4 (fp32)."""
    from llmem.components import autocast

    return plan.precision.compute_bytes if autocast.applies(plan) else FP32


def saved_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """What the head's adapter keeps from its forward to its backward. fp32: lora_A's input (x itself with dropout
    0, else dropout's output and noise) and lora_B's T × r input. Under autocast: dropout's fp32 noise (p > 0),
    lora_A's half cast of its input, lora_B's half T × r input, and both adapters' half weight casts (autocast's
    cached copies of fp32 leaves, saved by mm for the input gradients)."""
    if not targets_head(plan):
        return 0
    from llmem.components.activations import _proj_dim

    t, h, r, c = _tokens(plan), _proj_dim(spec), plan.lora_rank, _half(plan)
    noise = t * h * FP32 if plan.lora_dropout > 0 else 0  # dropout's noise, x's dtype (fp32) on CPU
    if c == FP32:
        return t * h * FP32 + noise + t * r * FP32  # x, or dropout's output; its noise
    return noise + t * h * c + t * r * c + (r * h + spec.vocab_size * r) * c


def forward_add_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Logits-related bytes at the adapter's add: base logits, the scaled adapter output and the sum (T × V each, in
    the compute dtype: fp32, or the autocast dtype)."""
    if not targets_head(plan):
        return 0
    return 3 * _tokens(plan) * spec.vocab_size * _half(plan)


def backward_scaled_grad_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`MulBackward0`'s `grad * scaling` (T × V) alive while lora_B's backward runs."""
    if not targets_head(plan):
        return 0
    return _tokens(plan) * spec.vocab_size * _half(plan)


def keeps_input(plan: TrainingPlan) -> bool:
    """Whether lora_A saves the final hidden states themselves (dropout 0, fp32: no cast, no dropout output)."""
    from llmem.components import autocast

    return targets_head(plan) and plan.lora_dropout == 0 and not autocast.applies(plan)


def check_supported(spec: ModelSpec, plan: TrainingPlan, target: str) -> None:
    """The adapted output layer is modelled on the hand-written LoRA families (`lora_activations` trait), whose
    final norm saves are counted by hand; elsewhere the traced tables would have to carry it (not done)."""
    from llmem.errors import GAP, InputError

    check_name(spec, target)
    if spec.derived is not None or not spec.family.lora_activations:
        raise InputError("lora-targets", f"LoRA on the output layer ({target}) is modelled for llama, mistral, "
                         f"qwen2, qwen3 and the other hand-modelled LoRA families, not yet for {spec.model_type}; "
                         f"leave {target} out of --lora-targets", GAP)
    from llmem.components.lora import targeted

    if not any(p.layer is not None for p in targeted(spec, plan)):
        raise InputError("lora-targets", f"LoRA on the output layer ({target}) without an adapted Linear in the "
                         "decoder layers is not modelled yet (nothing in the frozen layers then requires grad, so "
                         "they save nothing for backward); add a decoder-layer target such as q_proj,v_proj", GAP)
