"""LoRA under DeepSpeed ZeRO-3 (`--engine deepspeed --zero 3 --method lora`): the PEFT model passed to
`deepspeed.initialize` with the client optimizer over its adapters, as the HF Trainer does (deepspeed 0.19.0).

ZeRO-3 converts every parameter of the module, frozen or not (`DeepSpeedZeRoOffload._convert_to_zero_parameters`,
runtime/zero/parameter_offload.py): each is partitioned on its own (`ds_tensor`, ceil(n / W) elements), a tensor
of at most stage3_param_persistence_threshold elements persists whole, the others are gathered as their module
runs and released after the module's backward (`release_sub_module`, parameter_offload.py:454-457). The optimizer
holds only the adapters (`_get_trainable_parameter_groups`, stage3.py:580: `if p.requires_grad`): their
defragmented module-dtype partitions, fp32 master, states, partition-gradient buffer, the one bucket and its
reduces are `zero3_ds`' terms over the adapters (`ds_lora.trainable_spec`); the frozen partitions stay the
`ds_tensor`s of their own parameters (not defragmented: only the optimizer's groups are), Sigma_frozen x b. On one
rank (W = 1) a gather is a view of the whole partition (`_no_gather_coalesced`, partition_parameters.py:1449,
`NoGatherHandle` :68): the parameters are the partitions alone, whatever is gathered or released
(`zero3_ds.gathers_copy`; measured within -0.03%..0%, `tests/components/test_deepspeed_lora_zero3.py`).

Releases: a module whose output needs no gradient gets no pre-backward fetch (`_pre_backward_module_hook` wraps
only outputs that require one), so the trace never uses its tensors again and they are released after its forward
(`__params_to_release`, partitioned_param_coordinator.py:574): without checkpointing the frozen input embeddings and
the first layer's frozen modules up to its first adapted stage (`released_in_forward`). A module whose input needs
no gradient runs no post-backward hook (parameter_offload.py:370 `if input.requires_grad`): those stages' lora_A
stay gathered until the step's `_partition_all_parameters` (stage3.py:2419). The first iteration gathers an untied
lm_head again at its backward (`_first_iteration`). Checkpointed LoRA is refused: a frozen parameter released
before its layer's recompute is recomputed empty and torch's non-reentrant checkpoint raises (deepspeedai/
DeepSpeed#8148, after 0.19.0; `llmem.support`).
"""

from __future__ import annotations

import re

from llmem.components import Category, ds_lora, lora
from llmem.components import zero3_ds as z3
from llmem.components import zero_ds as z
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase

# a decoder layer's modules in the order its forward reads them, by stage (siblings of a stage read one input)
_STAGES = (re.compile(r"input_layernorm|ln_1\b|\.ln_1\.|norm1"),
           re.compile(r"q_proj|k_proj|v_proj|qkv|c_attn|query_key_value|Wqkv"),
           re.compile(r"o_proj|attn\.c_proj|attention\.dense|out_proj"),
           re.compile(r"post_attention_layernorm|pre_feedforward_layernorm|ln_2|norm2"),
           re.compile(r"gate_proj|up_proj|c_fc|fc1|dense_h_to_4h|gate_up"),
           re.compile(r"down_proj|mlp\.c_proj|fc2|dense_4h_to_h"))


_WORDS = re.compile(r"embed_tokens|wte|word_embeddings")  # the input embeddings a tied lm_head shares


def all_params_view(spec: ModelSpec, plan: TrainingPlan) -> ds_lora.TrainableView:
    """Every parameter of the PEFT model (the frozen base and its adapters): what ZeRO-3 partitions and gathers."""
    base = [*spec.outer_params, *(p for k in range(spec.num_layers) for p in spec.layer_params(k))]
    return ds_lora.TrainableView(spec, [*base, *lora.adapter_params(spec, plan)])


def _stage(name: str) -> int | None:
    return next((s for s, pattern in enumerate(_STAGES) if pattern.search(name)), None)


def _first_layer(view: ds_lora.TrainableView) -> tuple[set[int], set[int]]:
    """The first decoder layer's tensors (indices of the view's `ordered_numels`) that read the layer's input before
    any adapter: every stage up to the first one holding an adapter (its siblings read the same input). (frozen,
    adapters): the frozen ones' modules make an output that needs no gradient, so no pre-backward hook fetches them
    and the recorded trace never uses them again: released after their forward (`__params_to_release`,
    partitioned_param_coordinator.py:574); those adapters' modules (lora_A) read an input that needs no gradient,
    so they run no post-backward hook: gathered until the step. A frozen tensor of no known stage counts as kept."""
    from llmem.walk.deepspeed_hooks import _param_names

    names, keys = _param_names(view), z.backward_keys(view)
    stages = {i: _stage(names[i]) for i in range(len(names)) if keys[i] == 0}
    first = min((s for i, s in stages.items() if ".lora_" in names[i] and s is not None), default=len(_STAGES))
    early = {i for i, s in stages.items() if s is not None and s <= first}
    return ({i for i in early if ".lora_" not in names[i]},
            {i for i in early if ".lora_A." in names[i]})


def released_in_forward(spec: ModelSpec, plan: TrainingPlan) -> set[int]:
    """The frozen tensors whose module's output needs no gradient (indices of `all_params_view`): the input
    embeddings (their output needs none without checkpointing, whose PEFT hook is refused here; the word
    embeddings kept when tied to the lm_head, whose backward uses them; gpt2's position embeddings released) and
    the first layer's frozen modules before its first adapter (`_first_layer`)."""
    from llmem.walk.deepspeed_hooks import _param_names

    view = all_params_view(spec, plan)
    names = _param_names(view)
    tied = not z.untied_head_numel(spec)  # (a tied lm_head's module fetches the word embeddings in backward)
    return _first_layer(view)[0] | {i for i, key in enumerate(z.backward_keys(view)) if key < 0 and ".lora_" not in
                                    names[i] and not (tied and _WORDS.search(names[i]))}


def frozen_partition_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The frozen parameters' own partitions (`ds_tensor`, `_partition_param` partition_parameters.py:1657):
    ceil(n / W) elements of b each."""
    return sum(z3.aligned(p.numel, plan) // plan.dp for p in spec.params) * z.module_bytes(plan)


def parameter_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int | None) -> int:
    """Parameters at a moment after the first layer's forward (`layer`: None in forward, the layer in backward, -1
    after backward): the frozen partitions, the adapters' flat partitions, every persistent tensor whole and the
    gathered ones neither released in forward (`released_in_forward`) nor by the backward of a later layer, the
    final norm or the lm_head (the first layer's lora_A of `_first_layer` never is); the buffers."""
    view, train = all_params_view(spec, plan), ds_lora.trainable_spec(spec, plan)
    keys, gone = z.backward_keys(view), released_in_forward(spec, plan)
    kept = _first_layer(view)[1]
    alive = [i for i, key in enumerate(keys) if i not in gone and (layer is None or key <= layer or key < 0
                                                                    or i in kept)]
    return (frozen_partition_bytes(spec, plan) + z3.lp_bytes(train, plan) + z3.persistent_param_bytes(view, plan)
            + z3.gathered_bytes(view, plan, alive) + z.buffer_bytes(spec, plan))


def zero3_lora_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """The candidate peak moments of one steady-state iteration: the one-device LoRA walk's compute moments (half
    adapters under bf16, `ds_lora.walk_spec`; each adapter gradient freed at its hook, as under
    `--optimizer-in-backward`) with ZeRO-3's parameters (`parameter_bytes`) and the adapters' optimizer tensors,
    each bucket's reduce (`zero3_ds.reduce_temporary_bytes`) at the start of the backward of the layer whose hook
    overflows it (the epilogue's at the end of backward), then the step (`deepspeed3._step_moments`)."""
    from llmem.walk.deepspeed import compute_plan
    from llmem.walk.deepspeed3 import _fixed_gradients, _moment_layer, _step_moments
    from llmem.walk.single import iteration_phases

    train, walk = ds_lora.trainable_spec(spec, plan), ds_lora.walk_spec(spec, plan)
    step = next(ph for ph in iteration_phases(walk, compute_plan(plan)) if ph.name == "optimizer step")
    single = iteration_phases(walk, compute_plan(plan).with_(grad_accum=1, optimizer_in_backward=True))
    optimizer, fixed = z3.master_bytes(train, plan) + z3.state_bytes(train, plan), _fixed_gradients(train, plan)
    out, starts = [], {}
    for ph in single:
        if "step" in ph.name:
            continue
        layer = _moment_layer(ph.name, spec)
        b = {**ph.breakdown, Category.PARAMETERS: parameter_bytes(spec, plan, layer), Category.OPTIMIZER: optimizer,
             Category.GRADIENTS: ph.breakdown[Category.GRADIENTS] + fixed}
        out.append(Phase(ph.name, b))
        if layer is not None:
            starts.setdefault(layer, out[-1])
    keys, order = z.backward_keys(train), z3.buckets(train, plan)
    for k, tensors in enumerate(order):
        layer = keys[order[k + 1][0]] if k + 1 < len(order) else -1
        at = starts.get(min(layer, spec.num_layers - 1)) or starts[-1]
        b = {**at.breakdown, Category.TEMPORARIES: at.breakdown[Category.TEMPORARIES]
             + z3.reduce_temporary_bytes(train, plan, tensors)}
        out.append(Phase(f"ZeRO-3 reduce (bucket {k + 1})", b))
    out += _first_iteration(spec, plan, out)
    held = {"logits": step.breakdown[Category.LOGITS], "activations": step.breakdown[Category.ACTIVATIONS]}
    steps = _step_moments(train, plan, held)
    frozen = frozen_partition_bytes(spec, plan)
    return out + [Phase(ph.name, {**ph.breakdown, Category.PARAMETERS: ph.breakdown[Category.PARAMETERS] + frozen})
                  for ph in steps]


def check(spec: ModelSpec, plan: TrainingPlan) -> None:
    """Measured on dense models; a mixture-of-experts layer's gathers and releases are not (a gap)."""
    from llmem.errors import GAP, InputError

    if spec.is_moe:
        raise InputError("engine", f"LoRA under DeepSpeed ZeRO-3 is measured on dense models; {spec.model_type!r}'s "
                         "expert layers are not: use ZeRO-0/1/2, or --engine torch", GAP)


def _first_iteration(spec: ModelSpec, plan: TrainingPlan, moments: list[Phase]) -> list[Phase]:
    """The first iteration (the coordinator recording its trace, no optimizer states yet: AdamW makes them at the
    first step) gathers an untied, non-persistent lm_head again at its backward: twice its gathered bytes beside the
    lm_head's backward moment (measured on a per-phase timeline, llama, 2 ranks: +2 x 131,072 B at vocab 512 and
    +2 x 262,144 B at vocab 1024 in fp32, none in the second iteration; the input embeddings' gather at the start of
    each forward shows the same two copies, `_all_gather_sequential` partition_parameters.py:1275 over gloo). Under
    LoRA the states are small, so at short sequences this moment is the peak (fp32 q,v s16: -12% without it).
    Recording its trace, the coordinator releases every module's parameters after its forward
    (`release_sub_module`, partitioned_param_coordinator.py:474-475; `free_param` swaps `param.data`): what autograd
    saved keeps its buffer only through a view of its own, so `_record_freed_bytes` are gone at this moment.
    None on one rank, whose gathers are views (`zero3_ds.gathers_copy`)."""
    head = z.untied_head_numel(spec)
    at = next((ph for ph in moments if ph.name.startswith("lm_head backward")), None)
    if not head or at is None or z3.persists(head, plan) or not z3.gathers_copy(plan):
        return []
    train, view = ds_lora.trainable_spec(spec, plan), all_params_view(spec, plan)
    freed = _record_freed_bytes(spec, plan, view)
    b = {**at.breakdown, Category.OPTIMIZER: z3.master_bytes(train, plan),
         Category.PARAMETERS: at.breakdown[Category.PARAMETERS] - freed,
         Category.COMMUNICATION: at.breakdown[Category.COMMUNICATION] + 2 * z3.aligned(head, plan) * z.module_bytes(
             plan)}
    return [Phase("lm_head backward, first iteration (lm_head gathered again)", b)]


def _record_freed_bytes(spec: ModelSpec, plan: TrainingPlan, view: ds_lora.TrainableView) -> int:
    """The gathered bytes the recording iteration frees that the steady state keeps at its lm_head's backward. A
    Linear saves `weight.t()` (for its input's gradient), a view holding the gathered buffer: the frozen weights
    stay. Freed: the first layer's lora_A of `_first_layer` (their input needs no gradient: nothing saved) and
    every 1-D tensor (a norm weight, saved as the parameter itself, whose `.data` the release swaps; a bias, not
    saved). Measured, llama fp32 s16, 2 ranks (`llmem.measure.rank_timeline`): 13,576 B fewer than the steady state
    at this moment beside the AdamW states = 3 lora_A x 4,096 B + 5 norm weights x 256 B (+ 8 B)."""
    from llmem.walk.deepspeed_hooks import _param_names

    names, numels, gone = _param_names(view), z.ordered_numels(view), released_in_forward(spec, plan)
    shapes = {p.name: p.shape for p in (*view.outer_params, *(q for k in range(view.num_layers)
                                                                for q in view.layer_params(k)))}
    flat = [i for i, name in enumerate(names) if len(shapes[name]) == 1]
    whole = sum(numels[i] for i in flat if z3.persists(numels[i], plan)) * z.module_bytes(plan)
    return z3.gathered_bytes(view, plan, _first_layer(view)[1] | {i for i in flat if i not in gone}) + whole
