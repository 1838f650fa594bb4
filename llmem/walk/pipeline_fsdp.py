"""`--pp N --gpus pp × dp --zero 3`: what FSDP2 changes in a pipeline stage's moments (`walk.pipeline`).

The program (`runtime.pipeline.wrap_data_parallel`): torchtitan's `apply_fsdp` on each stage with
`reshard_after_forward=False` (torchtitan/models/llama3/infra/parallelize.py at 018740b: "For PP, by default do not
reshard after forward to avoid per-microbatch all-gathers"); torch 2.13's `PipelineStage` runs every backward with
`set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)` (pipelining/stage.py
`backward_maybe_with_nosync`), and reduce-scatters once, after the last backward, in `perform_reduce_grad`
(stage.py), which runs each group's `post_backward` with gradient sync and resharding on.

So from the first microbatch's forward to `perform_reduce_grad` a stage holds its parameters twice, sharded (the
padded shards, `parameter_bytes` of the stage under a ZeRO-3 plan over the dp ranks) and unsharded (each group's
all-gathered storage, `communication.layer_unsharded_bytes` / `root_unsharded_bytes`: kept, never resharded), and
its gradients unsharded on the unsharded parameters, accumulated over the microbatches as a one-GPU stage's are
(the walk's `gradients` unchanged); the optimizer states are sharded. `perform_reduce_grad` then walks the groups in
module order (`_state_ctx.all_states`: embedding, decoder layers, [norm, lm_head]); each group's `post_backward`
reshards its parameters, allocates the reduce-scatter input (padded, the reduce dtype), copies its gradients in
(`foreach_reduce_scatter_copy_in`; CPU: `_chunk_cat`'s padded copies), frees them, allocates the sharded output
(the new sharded gradient) and reduce-scatters (CPU: gloo's copy of the input); the input is kept until the next
group's `post_backward` pops it (`reduce_scatter_max_input_buffers=1`), the last one until the final callback.
"""

from __future__ import annotations

from llmem.components import communication as comm
from llmem.components import pipeline as pl
from llmem.components.gradients import gradient_bytes
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import parameter_bytes
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase, moment


def shard_plan(plan: TrainingPlan) -> TrainingPlan:
    """The one-microbatch plan of a stage as FSDP2 over its dp ranks (ZeRO-3): what the sharded terms read."""
    return pl.microbatch_plan(plan).with_(gpus=plan.dp, zero=3)


def persistent(spec: ModelSpec, plan: TrainingPlan, stage: int) -> dict[str, int]:
    """A stage's parameters (the sharded ones and, kept unsharded from the first forward, every group's gathered
    storage) and its sharded optimizer states."""
    s, q3 = pl.stage_spec(spec, plan, stage), shard_plan(plan)
    unsharded = sum(comm.layers_unsharded_bytes(s, q3)) + comm.root_unsharded_bytes(s, q3)  # each at its own size
    return {"parameters": parameter_bytes(s, q3) + unsharded, "optimizer": optimizer_state_bytes(s, q3)}


def _groups(s: ModelSpec, q: TrainingPlan, q3: TrainingPlan, first: bool) -> list[tuple[str, int, int, int, bool]]:
    """(name, unsharded parameter bytes, unsharded gradient bytes, reduce-scatter input bytes, outer) per FSDP2
    group of the stage, in module order: the embedding (stage 0), each decoder layer, [norm, lm_head] (the last
    stage); the stage's outer parameters are one group's (`components.pipeline.stage_spec`)."""
    elem = q.precision.param_bytes
    outer = [] if not s.outer_params else [("embedding" if first else "norm and lm_head", comm.root_unsharded_bytes(
        s, q3), sum(p.numel for p in s.outer_params) * elem, comm.root_reduce_scatter_input_bytes(s, q3), True)]
    layers = [(f"layer {i}", comm.layer_unsharded_bytes(s, q3, i), sum(p.numel for p in s.layer_params(i)) * elem,
               comm.layer_reduce_scatter_input_bytes(s, q3, i), False) for i in range(s.num_layers)]
    return outer + layers if first else layers + outer


def first_forward_phases(spec: ModelSpec, plan: TrainingPlan, stage: int, name: str, on: dict,
                         act: int) -> list[Phase]:
    """The step's first forward (microbatch 0, nothing else in flight, no gradient yet) all-gathers the stage's
    groups one after another and keeps each (`reshard_after_forward=False`): its last decoder layer's all-gather and
    copy-out, and on the last stage the [norm, lm_head] group's after the layers, with every earlier group gathered,
    the previous group's all-gather output retained (`all_gather_state`, freed when the copy-out returns) and the
    microbatch's activations so far (the one-GPU FSDP2 walk's `walk.fsdp_forward.layer_gather_moments`). `act`: the
    step's inputs."""
    from llmem.components import activations as acts

    s, q, q3 = pl.stage_spec(spec, plan, stage), pl.microbatch_plan(plan), shard_plan(plan)
    n, each, outer = s.num_layers, comm.layers_unsharded_bytes(s, q3), comm.root_unsharded_bytes(s, q3)
    first, last = stage == 0, stage == pl.num_stages(plan) - 1
    base = {"parameters": parameter_bytes(s, q3), "optimizer": on["optimizer"], "standing": on["standing"]}
    x, kept = pl.hidden_bytes(spec, plan), acts.kept_per_layer_bytes(spec, q)
    # layer 0 of stage 0 reads the embeddings' output; a later stage's first layer its receive buffer (standing),
    # which that layer saves where `input_saved`
    embeds = x if first and not acts.checkpoints_layers(q) and not acts.saves_layer_input(spec, q) else 0
    ran = (n - 1) * kept - (x if not first and n > 1 and pl.input_saved(spec, plan, stage) else 0)
    phases = []
    # each group at its own size (`layers_unsharded_bytes`); the last layer's is the one gathered at the moment
    groups = ([(f"layer {n - 1}", outer * first + sum(each[:n - 1]), each[n - 2] if n > 1 else outer * first,
                each[n - 1], False, ran + embeds + (x if first or n > 1 else 0))] if n else [])
    if last:
        groups.append(("norm and lm_head", sum(each), each[n - 1] if n else 0, outer, True, n * kept + embeds + x
                       - (x if not first and n and pl.input_saved(spec, plan, stage) else 0)))
    for label, gathered, retained, new, root, held in groups:
        held += act + (pl._outside_layers(spec, q) if n else 0)
        on_now = dict(base, parameters=base["parameters"] + gathered, activations=held)
        k = None if root else n - 1
        phases.append(moment(f"{name}first forward, {label} all-gather", **on_now,
                             communication=retained + comm.all_gather_bytes(s, q3, root=root, layer=k)))
        phases.append(moment(f"{name}first forward, {label} all-gather copy-out", **on_now,
                             communication=retained + 2 * new + comm.shard_dim1_copy_out_bytes(s, q3, root, k)))
    return phases


def reduce_phases(spec: ModelSpec, plan: TrainingPlan, stage: int, name: str, on: dict, held: int,
                  act: int) -> list[Phase]:
    """`perform_reduce_grad`, group by group (module docstring), each at its copy-in and at its collective, `held`
    the activations the schedule still references; then the optimizer step on the shards (`act`: the step's
    inputs)."""
    s, q, q3 = pl.stage_spec(spec, plan, stage), pl.microbatch_plan(plan), shard_plan(plan)
    sharded = {"parameters": parameter_bytes(s, q3), "optimizer": on["optimizer"], "standing": on["standing"]}
    groups = _groups(s, q, q3, stage == 0)
    left_params = sum(g[1] for g in groups)
    left_grads = gradient_bytes(s, q)
    done = 0  # sharded gradients made so far
    phases = []
    for i, (label, unsharded, grads, rs_input, outer) in enumerate(groups):
        k = None if outer else i - (len(groups) - s.num_layers if stage == 0 else 0)  # the decoder layer's index
        left_params -= unsharded  # `post_backward` reshards before it reduces
        pads = comm.chunk_cat_padding_bytes(s, q3, root=outer, layer=k)
        out = rs_input // plan.dp
        base = dict(sharded, parameters=sharded["parameters"] + left_params, activations=held)
        phases.append(moment(f"{name}reduce-scatter copy-in, {label}", **base, gradients=left_grads + done,
                             communication=rs_input, temporaries=pads))
        left_grads -= grads
        phases.append(moment(f"{name}reduce-scatter, {label}", **base, gradients=left_grads + done + out,
                             communication=rs_input + comm.reduce_scatter_scratch_bytes(s, q3, outer, k)))
        done += out
    phases.append(moment(name + "optimizer step", **sharded, gradients=gradient_bytes(s, q3),
                         activations=act, temporaries=optimizer_step_temporary_bytes(s, q3)))
    return phases
