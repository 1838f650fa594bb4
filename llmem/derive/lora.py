"""LoRA on a derived architecture: the PEFT model the trace runs, and what the plan's LoRA fields change in it.

The trace wraps the built model exactly as the measured step does (`llmem.runtime.lora.apply_method`):
`peft.get_peft_model(model, lora_config(plan))` with the plan's rank, alpha, dropout, target modules and
modules_to_save. `--grad-ckpt full` makes PEFT call `model.enable_input_require_grads()` (the base model is
gradient-checkpointing when PEFT wraps it: `PeftModel._prepare_model_for_gradient_checkpointing`), so the embedding
output, layer 0's input, requires grad; the tables are traced without checkpointing and the same hook, the layer
backward's windows on the checkpointed program (`checkpointed_windows`, `checkpointed_extra_bytes`).
Without it layer 0 saves less than the other layers (an op saves only when an input requires grad): it is simply a
layer kind of its own (`llmem.derive.kinds`), as the fit groups layers by what they save.
The walk is the one of every scheme but tensor parallelism (one GPU, DDP, ZeRO-1, FSDP2's ZeRO-2/3: with pure
precisions FSDP2 runs the same program on gathered parameters).
Under autocast the weight copies mm saves are traced into the layer tables (the frozen base's are made per use, the
adapters' cached until the forward's autocast region exits: `walk.single._cast_terms` counts those of checkpointed
layers at the forward's end).
With `--ckpt-every K` > 1 the layers left uncheckpointed run as without checkpointing but with layer 0's input
requiring grad (PEFT's hook); they are looked up by their own index in the tables of the uncheckpointed plan, whose
layer 0 is a kind of its own (`activations.varied`; looked up as the first layer they read 3-6% low).
FSDP2 with bf16-/fp16-mixed: its policy all-gathers the adapters cast to half, and the walk reads tables traced so
(`_half_adapters`, `Derived.with_half_adapters`).
QLoRA's 4-bit base: `llmem.derive.quant`, its 8-bit base: `llmem.derive.int8`; on a mixture of experts the experts and
routers stay unquantized (docs/MODEL-QLORA-MOE.md); on one GPU, DDP, ZeRO-1 and FSDP2 (ZeRO-2/3) alike: the traced
program is the rank's, the walk of each scheme adds its sharding (docs/MODEL-QLORA-SHARDED.md; an 8-bit base under
FSDP2 is a support row's refusal). Refused (one line naming the field): on expert layers, MLP targets PEFT does not
map onto the fused experts, and TP (`moe_refusal`).
"""

from __future__ import annotations

import copy

from llmem.errors import GAP, InputError
from llmem.plan import GradCkpt, TrainingPlan


def trace_key(plan: TrainingPlan) -> tuple:
    """The plan's fields that change the traced LoRA program: rank, alpha, dropout, targets, modules_to_save, and
    whether layer 0's input requires grad (`lora_activations.layer0_input_requires_grad`'s first cause), and whether
    layers are checkpointed (their backward window is traced on the checkpointed program too)."""
    from llmem.derive.quant import method_tag

    return (method_tag(plan), plan.lora_rank, plan.lora_alpha, plan.lora_dropout, plan.lora_targets,
            plan.lora_modules_to_save, input_requires_grad(plan), plan.grad_ckpt is GradCkpt.FULL)


def input_requires_grad(plan: TrainingPlan) -> bool:
    """Whether the embeddings' output (layer 0's input) requires grad in the traced program: with `--grad-ckpt full`
    for LoRA and QLoRA alike. PEFT skips its own input-require-grads hook for a 4/8-bit base
    (`PeftModel._prepare_model_for_gradient_checkpointing`), but transformers 5.23 calls it itself when checkpointing
    is enabled on a model taking input_ids (`modeling_utils.py`: `activation_checkpointing_enable`,
    `self.enable_input_require_grads()`), and the measured step enables checkpointing
    (`llmem.runtime.session.enable_checkpointing`)."""
    from llmem.components.lora_forward import embedding_output_requires_grad

    return embedding_output_requires_grad(plan)


def is_checkpointed(key: tuple) -> bool:
    """`trace_key`'s checkpointing field (its 8th), which a "half adapters" tag may follow
    (`Derived.with_half_adapters`): a tagged key's last element is that tag, not the flag."""
    return bool(key[7])


def wrap(model, key: tuple, checkpointed: bool = False):
    """The PEFT model of `trace_key`'s fields, as `llmem.runtime.lora.apply_method` builds it. PEFT moves each new
    adapter to its base layer's device and dtype (`_move_adapter_to_device_of_base_layer`, `module.to(device)`,
    which cannot swap a fake parameter), then casts half adapters back to fp32 (`autocast_adapter_dtype=True`): on
    the fake CPU device the adapters are made fp32 CPU tensors in the first place, so those moves are skipped."""
    from unittest import mock

    import torch
    from peft import get_peft_model
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    from llmem.quiet import quiet_libraries
    from llmem.runtime.lora import lora_config

    tag, rank, alpha, dropout, targets, to_save, input_grad, _ = key[:8]
    plan = TrainingPlan(method="lora", lora_rank=rank, lora_alpha=alpha, lora_dropout=dropout, lora_targets=targets,
                        lora_modules_to_save=to_save)
    to = torch.nn.Module.to

    def same_device(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return module if dtype is None and device in (None, torch.device("cpu")) else to(module, *args, **kwargs)

    with mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None), \
            mock.patch.object(ParamWrapper, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None), \
            mock.patch.object(torch.nn.Module, "to", same_device), mock.patch.object(copy, "deepcopy", _deepcopy), \
            quiet_libraries():
        if tag != "lora":  # --method qlora: the base quantized first, as `llmem.runtime.lora.apply_method` does
            from llmem.derive.quant import quantize

            model = quantize(model, tag)
        model = get_peft_model(model, lora_config(plan))
    adapters = [p for n, p in model.named_parameters() if p.requires_grad and ".lora_" in n]
    if any(p.dtype != torch.float32 for p in adapters):
        raise RuntimeError("the traced LoRA adapters are not fp32, as PEFT makes them")
    if key[8:] == ("half adapters",):
        _half_adapters(model)
    if input_grad and not checkpointed:  # a checkpointing base: PEFT called it
        model.enable_input_require_grads()
    return model


def _half_adapters(model) -> None:
    """FSDP2 with a MixedPrecisionPolicy(param_dtype=half): each group's all-gather casts every parameter, the fp32
    adapter shards too, to param_dtype (`torch/distributed/fsdp/_fully_shard/_fsdp_param.py`:
    `_get_param_all_gather_inputs`, `init_unsharded_param`), so forward and backward run on unsharded half adapters
    (leaves that require grad: their gradients are half until `foreach_reduce` copies them to reduce_dtype). The
    frozen base is already in the compute plan's half dtype."""
    import torch

    dtype = model.get_input_embeddings().weight.dtype  # the compute plan's half dtype (the model is built in it)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.requires_grad and p.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype))


_DEEPCOPY = copy.deepcopy


def _deepcopy(obj, memo=None):
    """`copy.deepcopy`, except for a module with fake parameters (PEFT's `ModulesToSaveWrapper` deep-copies the
    module it trains a copy of): `Tensor.__deepcopy__` copies a fake tensor's storage as if it held data, which
    leaves a tensor that crashes the process later; the copy clones each parameter and buffer instead (under the
    fake mode that is running: fake tensors of the same shape, dtype and requires_grad)."""
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(obj, nn.Module) or not any(isinstance(t, FakeTensor) for t in obj.parameters()):
        return _DEEPCOPY(obj, memo)
    new = copy.copy(obj)
    for key, value in obj.__dict__.items():  # the hook and attribute dicts, not shared with the original
        if isinstance(value, dict):
            new.__dict__[key] = type(value)(value)
    new._parameters = {k: p if p is None else nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                       for k, p in obj._parameters.items()}
    new._buffers = {k: b if b is None else b.clone() for k, b in obj._buffers.items()}
    new._modules = {k: m if m is None else _deepcopy(m) for k, m in obj._modules.items()}
    return new


def traced_derived(spec, config: dict):
    """The `Derived` whose tables are traced for LoRA on a hand-written family's spec. transformers builds the model
    its configuration class reads: a layer count llmem read under a key that class does not map (e.g. `n_layer` in
    an OPT config, whose `OPTConfig` keeps its default) would leave the spec and the traced model apart — refused,
    naming the key."""
    from llmem.derive import Derived
    from llmem.runtime.model import hf_config

    built = getattr(hf_config(config, TrainingPlan()), "num_hidden_layers", spec.num_layers)
    if isinstance(built, int) and built != spec.num_layers:
        key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if config.get(k) == spec.num_layers),
                   "num_hidden_layers")
        raise InputError(key, f"transformers' {spec.model_type} configuration does not read {key!r}: the model it "
                         f"builds has {built} decoder layers, not {spec.num_layers}; set num_hidden_layers")
    return Derived(config, spec.model_type)


def refusal(spec, plan: TrainingPlan) -> InputError | None:
    """What LoRA on a derived architecture (or a hand-written family traced for LoRA) does not model yet."""
    from llmem.derive.experts import TP_TRACED_MOE
    from llmem.derive.tables import static_refusal

    name = f"lora on {spec.model_type!r} (traced from transformers)"
    also = TP_TRACED_MOE if plan.tp > 1 else ()  # mixtral's, qwen2_moe's TP spec is traced (`llmem.derive.tp`)
    if spec.is_moe:
        return moe_refusal(spec, plan, name) or static_refusal(spec.derived.config, also)
    return static_refusal(spec.derived.config, also)


def moe_refusal(spec, plan: TrainingPlan, name: str) -> InputError | None:
    """LoRA on a derived mixture-of-experts model (`llmem.derive.experts`: grouped_mm experts, whose tensors have
    tokens × top_k rows whatever the routing, so the trace needs no routing values): modelled with named targets
    that are `nn.Linear`s outside the MLP blocks, and with `all-linear` or MLP names where PEFT 0.21.2 maps them
    onto the router and fused experts (`llmem.derive.lora_experts`: its ParamWrappers are in the traced program),
    on one GPU, DDP / ZeRO-1 (whose walk has the last layer's forward in flight,
    `Derived.forward_inflight_extra_bytes`) and FSDP2 ZeRO-2/3 (the walk of every scheme; the wrappers' adapters are
    sharded as any parameter; measured on 2 ranks within 0.11 %, tests/derive/test_lora_experts.py) and TP on
    column-parallel attention targets (`llmem.derive.tp`; tests/derive/test_tp_moe_lora.py). Not yet: `all-linear`
    or MLP names on a model PEFT does not rewrite (gpt_oss, granitemoe), and the experts or router adapted under TP."""
    from llmem.components.lora import linear_weights
    from llmem.derive import lora_experts
    from llmem.plan import ALL_LINEAR

    lora_experts.check(spec, plan)
    if plan.lora_targets == ALL_LINEAR and not lora_experts.converted(spec):
        return InputError("lora-targets", f"{name}: all-linear on a mixture-of-experts model may adapt its fused "
                          "experts (PEFT's ParamWrapper), which is not modelled yet; name the Linears, e.g. "
                          "q_proj,v_proj", GAP)
    mlp = {p.name.removesuffix(".weight").rsplit(".", 1)[-1] for p in linear_weights(spec) if ".mlp." in p.name}
    modules = {p.name.removesuffix(".weight").rsplit(".", 1)[-1] for p in linear_weights(spec)} - mlp
    named = set() if plan.lora_targets == ALL_LINEAR else {t.rsplit(".", 1)[-1] for t in plan.lora_targets.split(",")}
    other = sorted(named - modules - lora_experts.mapped_targets(spec, plan))
    if other:  # an MLP name (a shared expert's gate_proj) PEFT also maps onto the fused experts' gate_up_proj
        return InputError("lora-targets", f"{name}: {', '.join(other)} is not one of the model's Linears outside its "
                          "MLP blocks (PEFT maps MLP names onto the fused experts, not modelled yet); name the "
                          "attention Linears, e.g. q_proj,v_proj", GAP)
    if plan.tp > 1 and (plan.lora_targets == ALL_LINEAR or lora_experts.mapped_targets(spec, plan)):
        return InputError("tp", f"{name}: the router and the fused experts adapted under TP (PEFT's ParamWrapper on "
                          "transformers' moe_tp_experts shards) are not measured; name column-parallel attention "
                          "Linears, e.g. q_proj,k_proj,v_proj, or use --tp 1", GAP)
    return None


def checkpointed_windows(traced: tuple[list, list], layer_kinds: list[int], kind: str, offset: int) -> list:
    """Per layer kind, the backward window of its first layer traced on the checkpointed program (`--grad-ckpt
    full`; `traced`: the traces and check traces), its peak candidates fitted as `llmem.derive.kinds` does."""
    from llmem.derive.fit import fit_sequence
    from llmem.derive.kinds import peak_candidates

    traces, checks = traced
    out = []
    for k in range(max(layer_kinds) + 1):
        i = layer_kinds.index(k)
        events = fit_sequence(f"layer {i} checkpointed backward", [t.backwards[i] for t in traces],
                              [t.backwards[i] for t in checks], kind, offset)
        out.append([(n, list(c)) for n, c in peak_candidates(events)])
    return out


def checkpointed_extra_bytes(spec, plan: TrainingPlan, window: int) -> int:
    """LoRA with `--grad-ckpt full`: the first node of a checkpointed layer's backward that unpacks a saved tensor
    (e.g. the adapter's `* scaling`) recomputes the forward inside the layer's backward, whose locals outlive parts
    of it; so the window (`window`, the peak of `checkpointed_windows` of the layer's kind) is traced on the
    checkpointed program. Its live bytes include the recomputed saved tensors except the layer input (the
    checkpoint held it before), which the walk counts as the recompute (`activations.recompute_bytes`: the table
    plus the input where the table lacks it)."""
    from llmem.components import activations as act

    recomputed = act.layer_activation_bytes(spec, plan) + act.checkpointed_input_extra_bytes(spec, plan)
    return window - (recomputed - act.checkpointed_layer_bytes(spec, plan))
