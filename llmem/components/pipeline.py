"""`--pp N`: what one pipeline stage holds (DESIGN.md "What runs, per option"; the program: llmem.runtime.pipeline).

Pure functions of (ModelSpec, TrainingPlan, stage). The schedule's lines are torch 2.13.0's
torch/distributed/pipelining/schedules.py (S) and stage.py (T).
"""

from __future__ import annotations

from llmem.errors import GAP, REFUSED, InputError
from llmem.plan import PpSchedule, TrainingPlan


def stage_layer_counts(layers: int, pp: int) -> list[int]:
    """Decoder layers per stage, torchtitan's `generate_llm_fqn_per_model_part(pp, layers, 1, 1)`
    (torchtitan/distributed/pipeline_parallel.py at 02ef790): `layers + 2` effective layers (the embedding and
    norm + lm_head count one each), `e // pp` per stage, the first `e % pp` stages one more; stage 0 and the last
    stage give one of theirs to the embedding and to the head. Raises InputError where torchtitan raises
    (`pp > layers + 2`: a stage would be empty)."""
    effective = layers + 2
    per, extra = divmod(effective, pp)
    if per < 1:
        raise InputError("pp", f"{pp} stages exceed the {effective} effective layers ({layers} decoder layers + the "
                         f"embedding + the head; torchtitan refuses empty stages); use --pp {effective} or fewer",
                         REFUSED)
    counts, left = [], layers
    for stage in range(pp):
        n = per + (stage < extra) - (stage == 0) - (stage == pp - 1 and pp > 1)
        n = min(n, left) if stage < pp - 1 else left
        counts.append(n)
        left -= n
    return counts


def stages_per_rank(plan: TrainingPlan) -> int:
    """Stages on each rank: `--pp-stages-per-rank` under the looped schedule, else 1."""
    return plan.pp_stages_per_rank if plan.pp_schedule is PpSchedule.INTERLEAVED_1F1B else 1


def num_stages(plan: TrainingPlan) -> int:
    """The pipeline's stages (torchtitan's `num_virtual_stages = pp * stages_per_rank`)."""
    return plan.pp * stages_per_rank(plan)


def rank_stages(plan: TrainingPlan, rank: int) -> list[int]:
    """The stages rank `rank` runs: torchtitan's "loop" style `pp_rank + s * pp_degree` (`pipeline_module_split`'s
    `_get_stage_indices`), i.e. stage i on rank i % pp (torch's `generate_stage_to_rank_mapping`, loop style)."""
    return [rank + v * plan.pp for v in range(stages_per_rank(plan))]


def check(spec, plan: TrainingPlan) -> None:
    """The model-dependent refusals of `--pp`: the split must exist (under LoRA every rank with a decoder layer: an
    adapter to train), the family's forward be the llama-like one, the embeddings untied (a weight cannot be shared
    by two ranks' stages)."""
    counts = stage_layer_counts(spec.num_layers, num_stages(plan))
    from llmem.families import has_trait, with_trait
    from llmem.plan import Method

    idle = [r for r in range(plan.pp) if not sum(counts[s] for s in rank_stages(plan, r))]
    if plan.method is not Method.FULL and idle:  # its optimizer would get no parameter: torch.optim raises
        raise InputError("pp", f"under LoRA the stages of GPU {idle[0]} hold no decoder layer, so no adapter to "
                         f"train (torch.optim refuses an empty parameter list); use --pp {plan.pp - 1} or fewer, or "
                         "a model with more layers", REFUSED)
    if not has_trait(spec.model_type, "pipeline_stages") or spec.derived is not None or spec.is_moe:
        families = ", ".join(with_trait("pipeline_stages"))
        raise InputError("pp", f"pipeline stages are built and measured for {families} (dense); "
                         f"{spec.model_type!r} is not modelled; use --pp 1", GAP)
    if spec.tie_word_embeddings:
        # torchtitan refuses it (models/qwen3/model.py `update_from_config`: NotImplementedError "Weight tying is
        # not supported with Pipeline Parallel."); its split deep-copies the model per stage, so the embedding and the
        # lm_head would become two weights trained apart
        raise InputError("pp", "tied embeddings put one weight on the first and the last stage; torchtitan refuses "
                         "weight tying with pipeline parallelism; use an untied model, or --pp 1", REFUSED)


def in_flight(plan: TrainingPlan, stage: int) -> int:
    """Microbatches whose activations a stage holds at once. GPipe: all M forwards run before the first backward
    (S:905-928 forward loop, S:930-951 backward loop). 1F1B: `warmup_chunks = min(M, pp - stage)` forwards
    (S:1050-1053), then each backward is followed by one forward (S:1099-1146), so never more than that."""
    if plan.pp_schedule is PpSchedule.GPIPE:
        return plan.microbatches
    return min(plan.microbatches, plan.pp - stage)


def forward_after_backward(plan: TrainingPlan, stage: int) -> bool:
    """Whether a forward runs once gradients exist: 1F1B with more microbatches than its warm-up forwards (the
    steady state's forward after each backward, S:1123-1146); GPipe never (S:905-928 before S:930)."""
    return plan.pp_schedule is PpSchedule.ONE_F_ONE_B and plan.microbatches > in_flight(plan, stage)


def later_in_flight(plan: TrainingPlan, stage: int) -> int:
    """Microbatches held (the one running backward included) at the second backward, every gradient alive: GPipe
    M - 1 (the first one's freed); 1F1B k when a forward refilled the window (`forward_after_backward`), else
    k - 1."""
    k = in_flight(plan, stage)
    return k if forward_after_backward(plan, stage) else k - 1


def microbatch_plan(plan: TrainingPlan) -> TrainingPlan:
    """A one-GPU plan of one microbatch (`batch_size / M` sequences): what the per-layer terms of a stage read.
    `split_args_kwargs_into_chunks` splits the step's batch along dim 0 into M views (microbatch.py)."""
    return plan.with_(gpus=1, pp=1, zero=0, pp_schedule=PpSchedule.ONE_F_ONE_B, pp_stages_per_rank=2,
                      microbatches=1, batch_size=plan.batch_size // plan.microbatches)


def stage_spec(spec, plan: TrainingPlan, stage: int):
    """The spec of the stage's own parameters (`runtime.pipeline.Stage` registers them in model order): stage 0 the
    embedding, the last stage the final norm and lm_head, each its decoder layers (renumbered from 0)."""
    from dataclasses import replace

    counts = stage_layer_counts(spec.num_layers, num_stages(plan))
    start, n = sum(counts[:stage]), counts[stage]
    first, last = stage == 0, stage == num_stages(plan) - 1
    outer = spec.outer_params
    keep = [outer[0]] if first else []
    keep += [replace(p, layer=p.layer - start) for p in spec.params
             if p.layer is not None and start <= p.layer < start + n]
    keep += list(outer[1:]) if last else []
    return spec.memo(("pp-stage", num_stages(plan), stage), lambda: replace(spec, num_layers=n, params=tuple(keep)))


def hidden_bytes(spec, plan: TrainingPlan) -> int:
    """One microbatch's hidden states between stages (tokens × h in the residual stream's dtype: fp32 under
    autocast, whose residual adds promote): what a stage sends, receives and sends back as a gradient."""
    from llmem.components.activations import _bytes

    q = microbatch_plan(plan)
    return q.batch_size * q.seq_len * spec.hidden_size * _bytes(q)[1]


def buffer_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """The pipeline's own buffers, made in the first step and kept: every stage after the first one receive buffer
    per microbatch (T:2243-2273 `_setup_forward_recv_info`, `_make_tensor_from_meta` per chunk), every stage before
    the last one gradient receive buffer per microbatch (T:2286-2318 `_create_grad_recv_info`)."""
    return plan.microbatches * hidden_bytes(spec, plan) * ((stage > 0) + (stage < num_stages(plan) - 1))


def ddp_bucket_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """`--gpus` = pp × dp with `--zero 0`: the `Reducer` buckets of the stage's `DistributedDataParallel`
    (`runtime.pipeline.wrap_data_parallel` wraps each stage apart): one flat copy of the stage's gradients in the
    parameters' dtype, allocated at construction and alive for the whole run (`communication.ddp_bucket_bytes`,
    torch/csrc/distributed/c10d/reducer.cpp `Reducer::initialize_buckets`). The last backward copies each `.grad`
    into its bucket view and the all-reduce runs in place, so nothing else is allocated for it."""
    if plan.dp == 1 or plan.zero != 0:
        return 0
    return stage_spec(spec, plan, stage).total_params * plan.precision.param_bytes


def standing_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """What a stage holds through the whole step beyond parameters and optimizer states: the pipeline's buffers
    (`buffer_bytes`) and, with data parallelism beside it, DDP's buckets (`ddp_bucket_bytes`)."""
    return buffer_bytes(spec, plan, stage) + ddp_bucket_bytes(spec, plan, stage)


def input_gradient_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """A stage after the first sends each microbatch's input gradient back (`stage_backward` drops the receive
    buffer's `.grad`, _backward.py:440-450; `get_bwd_send_ops` pops it, T:529-547); the send's work keeps it until
    waited. GPipe waits for all of them after the last backward (S:953-955): M at the end of backward."""
    return plan.microbatches * hidden_bytes(spec, plan) * (stage > 0)


def step_input_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """The step's token ids (int64, batch × seq), drawn on every rank (stage 0 reads them as inputs, the last as
    labels; `split_args_kwargs_into_chunks` makes views)."""
    return plan.batch_size * plan.seq_len * 8


def _outside_layers(spec, q: TrainingPlan) -> int:
    """What a stage computes per microbatch outside its layers and its layers save (RoPE's cos and sin; with
    checkpointing the position ids the layers hold): the one-GPU `outer_saved` but the input ids."""
    from llmem.components.activations import outer_saved

    return sum(s.bytes for s in outer_saved(spec, q) if not s.name.startswith("input_ids"))


def head_held_bytes(spec, plan: TrainingPlan) -> int:
    """What the last stage holds per microbatch from its forward to its backward beyond the layers: the final norm's
    and lm_head's saved tensors, the logits (the stage output, kept in `fwd_cache`, T:913-916) and what the loss
    saved (its log-softmax output and shifted labels: `logits.loss_backward_start_bytes`, the one-GPU walk's state
    when `loss.backward()` starts); the schedule keeps the loss until that microbatch's backward (S:299-304)."""
    from llmem.components import logits as lg
    from llmem.components.pipeline_lora import final_norm_bytes

    q = microbatch_plan(plan)
    return final_norm_bytes(spec, q) + lg.loss_backward_start_bytes(spec, q)


def input_saved(spec, plan: TrainingPlan, stage: int) -> bool:
    """Whether the stage's input (a receive buffer after stage 0, counted in `buffer_bytes`) is among what its first
    module saves: a checkpointed first layer saves its input; else the first RMSNorm (input layernorm, or the final
    norm of a stage without layers) saves it when the residual stream is already fp32 (fp32, mixed precision;
    `components.activations`), and in pure half an fp32 copy of it instead."""
    from llmem.components.activations import _bytes

    q = microbatch_plan(plan)
    counts = stage_layer_counts(spec.num_layers, num_stages(plan))
    first_layer = sum(counts[:stage])
    return (counts[stage] > 0 and q.checkpointed(first_layer)) or _bytes(q)[1] == 4


def microbatch_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """One microbatch's activations held on a stage between its forward and backward: its layers' kept tensors
    (`activations.kept_per_layer_bytes`) and RoPE's; not the stage's input where its first module saves it (a
    receive buffer after stage 0, `buffer_bytes`; `input_saved`); before the last stage the output, kept in
    `fwd_cache` for backward (T:913-916); on the last stage the head's (`head_held_bytes`)."""
    from llmem.components.pipeline_lora import kept_per_layer_bytes, stage_first_saving_bytes

    q = microbatch_plan(plan)
    n = stage_layer_counts(spec.num_layers, num_stages(plan))[stage]
    x = hidden_bytes(spec, plan)
    held = n * kept_per_layer_bytes(spec, q) + (_outside_layers(spec, q) - stage_first_saving_bytes(spec, q, stage)
                                                 if n else 0)
    held += head_held_bytes(spec, plan) if stage == num_stages(plan) - 1 else x
    return held - (x if stage > 0 and input_saved(spec, plan, stage) else 0) + saved_copy_bytes(spec, plan, stage)


def layer_free_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """At the backward of a stage's first layer, what the microbatch holds beside that layer's tensors: RoPE's (less
    the layer input, a receive buffer, after stage 0)."""
    q = microbatch_plan(plan)
    return _outside_layers(spec, q) - (hidden_bytes(spec, plan) if stage > 0 and input_saved(spec, plan, stage) else 0)



def saved_copy_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """bf16-mixed: autocast runs each stage forward (`runtime.pipeline.Stage`) and its cache of half weight copies is
    cleared when that forward returns, so a microbatch keeps the copies its mm saved: each layer not checkpointed
    (`autocast.saved_layer_copies`) and, on the last stage, the lm_head's (`head_weight_copy_bytes`)."""
    from llmem.components import autocast

    q = microbatch_plan(plan)
    n = stage_layer_counts(spec.num_layers, num_stages(plan))[stage]
    from llmem.components.pipeline_lora import first_layer_unsaved_copy_bytes

    head = autocast.head_weight_copy_bytes(spec, q) if stage == num_stages(plan) - 1 else 0
    first = first_layer_unsaved_copy_bytes(spec, q) if stage == 0 and n else 0  # LoRA: stage 0's layer 0
    return autocast.saved_layer_copies(q, n) * autocast.layer_weight_copy_bytes(spec, q) + head - first


def head_freed_bytes(spec, plan: TrainingPlan) -> int:
    """On the last stage, what a microbatch's backward frees in its loss and lm_head backward: the head's held
    tensors (`head_held_bytes`) and the lm_head's saved half weight copy (bf16-mixed)."""
    from llmem.components import autocast

    return head_held_bytes(spec, plan) + autocast.head_weight_copy_bytes(spec, microbatch_plan(plan))


def held_output_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """Before the last stage, the output of a microbatch already backwarded, still referenced by its forward send's
    work: GPipe keeps every forward send's work in `fwd_sends_to_wait` until the step returns (S:902-928), so one
    at its second backward. 1F1B keeps its last fired warm-up send (microbatch k - 2) in `send_work` until the
    cooldown reassigns it (S:1062-1093, S:1147): beside k in flight only if a steady-state backward comes after
    microbatch k - 2's, i.e. k >= 2 and M >= 2k - 1 (the 1B1F loop runs backwards 0 .. M - k)."""
    k = in_flight(plan, stage)
    if stage == num_stages(plan) - 1:
        return 0
    held = plan.pp_schedule is PpSchedule.GPIPE or (k >= 2 and plan.microbatches >= 2 * k - 1)
    return hidden_bytes(spec, plan) * held


def forward_cache_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """bf16-mixed: at the end of a stage forward, autocast's cache still holds the copies no mm saved (those of the
    checkpointed layers: `autocast.forward_copy_layers` less `saved_layer_copies`; LoRA: stage 0's layer-0 lora_A
    copies, `pipeline_lora.first_layer_cached_copy_bytes`), freed as the forward returns."""
    from llmem.components import autocast

    q = microbatch_plan(plan)
    n = stage_layer_counts(spec.num_layers, num_stages(plan))[stage]
    from llmem.components.pipeline_lora import cached_copy_bytes, first_layer_cached_copy_bytes

    unsaved = autocast.forward_copy_layers(spec, q, n) - autocast.saved_layer_copies(q, n)
    return unsaved * cached_copy_bytes(spec, q) + (first_layer_cached_copy_bytes(spec, q) if stage == 0 and n else 0)


def layer_forward_bytes(spec, plan: TrainingPlan, stage: int) -> int:
    """Inside the forward of the stage's last decoder layer, beyond the stage's forward moment (a microbatch's
    `microbatch_bytes` made in full): the layer's transients, from the layer tables' own terms — LoRA's down_proj
    adapter (`lora_forward.down_proj_inflight_bytes`), a checkpointed layer's MLP (`checkpointed_forward`) — less
    what the stage makes after them: before the last stage its output (`hidden_bytes`, the layer's residual add), on
    the last stage the head's held tensors and the lm_head's weight copy (`head_freed_bytes`); and, where the
    transients count the layer's unsaved input (LoRA in pure half), a stage's single layer's input is its receive
    buffer (`buffer_bytes`, after stage 0). 0 for a stage without layers or where neither applies."""
    from llmem.components import checkpointed_forward
    from llmem.components.activations import _bytes
    from llmem.components.lora_forward import down_proj_inflight_bytes

    q = microbatch_plan(plan)
    counts = stage_layer_counts(spec.num_layers, num_stages(plan))
    n = counts[stage]
    if not n:
        return 0
    last_layer = sum(counts[:stage]) + n - 1
    lora = down_proj_inflight_bytes(spec, q)
    inflight = lora or checkpointed_forward.mlp_forward_bytes(spec, q, last_layer)
    if not inflight:
        return 0
    later = head_freed_bytes(spec, plan) if stage == num_stages(plan) - 1 else hidden_bytes(spec, plan)
    received = hidden_bytes(spec, plan) if lora and n == 1 and stage > 0 and _bytes(q)[1] != 4 else 0
    return max(0, inflight - later - received)
