"""The estimate's own allocation request stream — one tensor a request, in the program's order, on its stream —
replayed through the caching-allocator model (llmem/allocator.py, the rules of c10/cuda/CUDACachingAllocator.cpp,
torch 2.13) for the high end of reserved memory (`Estimate.reserved_bytes_range`). A category sum cannot see
cross-kind reuse (gradients carved from the freed logits blocks, optimizer states from freed activations): a replay
of the tensors themselves follows the allocator's best fit instead (docs/notes/2026-11-27-reserved-replay.md).

The program is DESIGN.md section 1's: the model built in full on the device (`from_config`, registration order),
wrapped, then two iterations (the second the steady state; segments are never given back, so
`max_memory_reserved` is the reserved bytes after the second). Requests per phase, each from the component that
sizes it in the walk:
  build     every parameter in `model.parameters()` order (`trained.model_order`), in full; a tied lm_head's own
            weight, allocated by its `nn.Linear` and freed when tied.
  wrap      TP: `distribute_tensor` per split parameter, its shard (a row-wise weight's after two shard-sized
            transposed copies), then the full tensor freed. DDP / ZeRO-1: `Reducer::initialize_buckets`' one
            bucket (torch/nn/parallel/distributed.py `_get_bucket_size_limits`: `[sys.maxsize]` without
            find_unused_parameters), rebuilt at iteration 2's forward into 1 MiB / 25 MiB buckets in
            gradient-ready order, the old freed first (reducer.cpp).
  forward   the embedding output; per decoder layer autocast's half weight copies (saved by the matmuls,
            `autocast`) and the layer's saved tensors (`activations.layer_saved`), each kept to the layer's
            backward, with the layer's fp32 residual-stream temporary (RMSNorm's `pow`) freed at once.
  loss      the half lm_head weight copy, the logits (held by the loop through the step: `logits.logits_bytes`),
            their fp32 upcast (freed after log_softmax) and the fp32 log_softmax output.
  backward  nll_loss's and log_softmax's fp32 gradients, the half logits gradient, the lm_head's gradients; per
            layer, last first, each parameter's gradient (a half gradient cast to the fp32 `.grad` under autocast,
            `ToCopyBackward0`) in reverse registration order, then the layer's saved tensors freed; the embedding's
            `embedding_dense_backward` (a tied weight's: summed in place with the lm_head's under autocast, into a
            new tensor outside it, where the waiting lm_head gradient is a view: `_backward`).
  step      per parameter group (`optimizer._group_bytes`: ZeRO-1 this rank's partition, TP the DTensor group and
            the plain one): in iteration 1 `_init_group`'s `exp_avg`, `exp_avg_sq` per tensor (`zeros_like`), then
            foreach AdamW's one temporary list (`_foreach_sqrt(exp_avg_sqs)`, torch/optim/adamw.py
            `_multi_tensor_adamw`), freed; `zero_grad(set_to_none)` frees the gradients.
FSDP2 and FSDP1 wrap and run otherwise, each request on its stream: `request_stream_fsdp`, `request_stream_fsdp1`
(docs/notes/2026-11-27-fsdp2-request-stream.md, 2026-11-28-fsdp1-reserved.md). Checkpointed: `request_stream_ckpt`.
The point figure replays the stream with the cache emptied after wrapping (`request_stream_point`). The stream is
written as columns (`request_events.Requests`), each decoder layer's requests by a body of its own run once per kind
of layer and repeated with shifted keys (`Requests.layer`, docs/notes/2026-11-28-stream-writing.md). Left out: the
op-level temporaries that live for an op or two, carved from blocks freed moments before: without them the replay is
within 3 % of `simulate`'s (every aten allocation of the real runtime through the same model) on the full-size
one-GPU, DDP, ZeRO-1, FSDP2 and FSDP1 rows and held-out pure-bf16, fp32, small-model rows. Under TP they decide
whether a freed logits block stays whole (qwen2.5-1.5b: −6.9 % without them), so the TP layers are written op by op
(`request_stream_tp`, `per_op`; docs/notes/2026-11-27-reserved-tp-bf16.md). Plans outside `replays` keep the
category rules (`reserved.reserved_bytes`).
"""

from __future__ import annotations

import math

from llmem.allocator import CachingAllocator
from llmem.allocator_replay import peak_reserved
from llmem.choices import Attention, Float8, FsdpShard
from llmem.components import autocast
from llmem.components import communication as comm
from llmem.components import request_stream_ckpt as ckpt_ops
from llmem.components import request_stream_fsdp as fsdp
from llmem.components import request_stream_fsdp1 as fsdp1
from llmem.components import request_stream_tp as tp_ops
from llmem.components import request_stream_tp_forward as tp_forward
from llmem.components.activations import layer_saved
from llmem.components.logits import _sizes
from llmem.components.optimizer import _group_bytes
from llmem.components.request_events import Requests, Stream, layer_kinds
from llmem.components.request_stream_tp import applies as per_op
from llmem.components.sharding import FSDP_SCHEMES, fsdp_shard_dim, local_numel, tp_local_shape
from llmem.components.trained import model_order
from llmem.families import has_trait
from llmem.plan import (
    Device,
    Engine,
    GradCkpt,
    Loss,
    Method,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Scheme,
    TrainingPlan,
)
from llmem.spec import ModelSpec, TpSplit

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 << 20  # DistributedDataParallel(bucket_cap_mb=25)
SCHEMES = (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1, Scheme.TP, *FSDP_SCHEMES)
PRECISIONS = (Precision.FP32, Precision.BF16, Precision.BF16_MIXED)


def replay_reserved(events: list[tuple[int, int, int]], expandable: bool = False) -> int:
    """`max_memory_reserved` after replaying `events` through the allocator model (nothing emptied); default
    segments by the flat loop of the same rules (`allocator_replay.peak_reserved`)."""
    if not expandable:
        return peak_reserved(events)
    alloc = CachingAllocator(expandable_segments=expandable)
    blocks: dict[int, object] = {}
    malloc, free = alloc.malloc, alloc.free
    for key, nbytes, stream in events:
        if nbytes > 0:
            blocks[key] = malloc(nbytes, stream)
        else:
            free(blocks.pop(key, None))
    return alloc.peak_reserved


# schemes whose replay meets simulate's within 3 % on every row (docs/notes/2026-11-27-fsdp2-request-stream.md)
REPLAYED = (Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1, Scheme.TP, *FSDP_SCHEMES)


def covers(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """The plans whose program the stream writes out: full fine-tuning of a llama-like dense decoder on one GPU,
    DDP, ZeRO-1, TP, FSDP2 (ZeRO-2/3, TP × FSDP2, dim-0 shards: `_dim0_shards`) or FSDP1 (`request_stream_fsdp1
    .applies`) on CUDA in fp32, bf16 or bf16-mixed (fp16-mixed adds GradScaler's step), SDPA (eager attention's
    fp32 softmax temporaries are not written out), checkpointing as `_checkpointing` says, no accumulation, offload
    or float8, foreach AdamW stepped after backward, `zero_grad(set_to_none)`, the standard loss."""
    return (plan.device is Device.CUDA and plan.scheme in SCHEMES and plan.method is Method.FULL
            and (plan.engine is Engine.TORCH or fsdp1.applies(plan)) and _checkpointing(plan) and plan.grad_accum == 1
            and plan.precision in PRECISIONS and plan.attn is Attention.SDPA and plan.float8 is Float8.NONE
            and plan.optimizer is Optimizer.ADAMW and plan.effective_optimizer_impl is OptimizerImpl.FOREACH
            and not plan.optimizer_in_backward and not plan.keep_grads and plan.loss is Loss.STANDARD
            and plan.offload is Offload.NONE and not plan.activation_offload
            and not plan.ddp_bucket_view and _dim0_shards(spec, plan) and plan.pp == 1 and plan.cp == 1
            and not spec.is_moe and spec.derived is None and has_trait(spec.model_type, "request_stream"))


def _dim0_shards(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """FSDP2's dim-0 shards: `--fsdp-shard dim0`, or dim1-if-short where no tensor takes `Shard(1)` (its placement
    function, `runtime.parallel._dim1_if_short`, returns None — Shard(0) — for a tensor with at least as many dim-0
    rows as ranks: every tensor of a dense decoder at the data-parallel sizes one plans)."""
    return plan.fsdp_shard is FsdpShard.DIM0 or plan.scheme not in FSDP_SCHEMES or not any(
        fsdp_shard_dim(tp_local_shape(p, plan.tp), plan) for p in spec.params)


def _checkpointing(plan: TrainingPlan) -> bool:
    """None; full (any `ckpt_every`); selective under FSDP2 or autocast (`request_stream_ckpt.applies`)."""
    return plan.grad_ckpt is GradCkpt.NONE or plan.scheme in FSDP_SCHEMES or ckpt_ops.applies(plan)


def replays(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether the high end of reserved memory (default segments) is this replay's: a plan `covers` accepts, of a
    scheme in `REPLAYED` (TP: its layers written op by op, `per_op`, under autocast, in fp32 or in pure bf16)."""
    return plan.scheme in REPLAYED and covers(spec, plan) and (plan.scheme is not Scheme.TP or per_op(plan))


def replayed_reserved_bytes(spec: ModelSpec, plan: TrainingPlan, expandable: bool = False) -> int:
    """`max_memory_reserved` of the plan's request stream (`program_requests`), with default or expandable
    segments; kept per plan. The stream is written once per layout (`plan.layout_key`) with the sizes that follow
    the micro-batch and the sequence as named slots (`_Skeleton`), filled per plan: the same events."""
    return spec.memo(("replayed_reserved", plan.key, expandable), lambda: _replayed(spec, plan, expandable),
                     per_plan=True)


def _replayed(spec: ModelSpec, plan: TrainingPlan, expandable: bool) -> int:
    sizes = _PlanSizes(spec, plan)
    skeleton, _ = layout_stream(spec, plan, sizes)
    slots = sizes.slots()
    # keyed by the stream itself: layouts that write the same stream (DDP on 2 ... 64 GPUs) replay it once
    return spec.memo(("replayed_stream", skeleton, tuple(slots.items()), expandable),
                     lambda: _replay_slots(skeleton, slots, expandable), per_plan=True)


def layout_stream(spec: ModelSpec, plan: TrainingPlan, sizes: _PlanSizes) -> tuple[tuple, tuple]:
    """The plan's layout's stream, its sizes as slots (`_Skeleton`), written once per layout for the high end and the
    point figure: (`Requests.columns`, the phase marks)."""
    shape = (len(sizes.table), sizes.upcast, tuple(sizes.names))  # the stream's structure besides the layout
    policy = ckpt_ops.policy_sizes(spec, plan, None)  # selective under FSDP2: the policy outputs' slots

    def write() -> tuple[tuple, tuple]:
        req = program_requests(spec, plan, _Skeleton(*shape, *policy))
        return Stream(req.columns()), tuple(req.marks)
    return spec.memo(("request_skeleton", plan.layout_key, shape), write, per_plan=True)


def _replay_slots(skeleton: tuple, slots: dict, expandable: bool) -> int:
    """The layout's stream (`Requests.columns`: keys, sizes, streams) replayed with the plan's `slots` filled in."""
    events = zip(*skeleton, strict=False)  # one length: `Requests` writes the three together
    if not expandable:
        return peak_reserved(events, slots)
    return replay_reserved([(k, slots.get(n, n), st) for k, n, st in events if slots.get(n, n)], expandable)


class _PlanSizes:
    """The requests whose bytes follow the micro-batch and the sequence: the embedding output (`residual`),
    RMSNorm's fp32 `pow`, the layer's saved tensors (`table`), the logits in the compute dtype and in fp32, the
    lm_head's input gradient (`g_in`); `upcast`: whether the logits are upcast (compute dtype narrower than fp32)."""

    def __init__(self, spec: ModelSpec, plan: TrainingPlan) -> None:
        half, l32, tokens = _sizes(spec, plan)
        # the embedding's output: the weight's dtype (FSDP2 gathers it in param_dtype; autocast leaves it fp32)
        weight = comm.gather_bytes(plan) if plan.scheme in FSDP_SCHEMES else plan.precision.param_bytes
        self.residual = tokens * spec.hidden_size * weight
        self.pow = tokens * spec.hidden_size * 4
        casts = autocast.applies(plan) or plan.scheme not in FSDP_SCHEMES  # FSDP2 runs no autocast: no input casts
        saved = [s for s in layer_saved(spec, plan) if casts or not s.name.startswith("autocast input")]
        self.table, self.names = [s.bytes for s in saved], [s.name for s in saved]
        self.tokens = tokens
        per_layer = per_op(plan) or ckpt_ops.applies(plan) or plan.grad_ckpt is GradCkpt.SELECTIVE  # op sizes
        self.tp = tp_ops.slots(spec, plan, tokens) if per_layer else {}
        self.policy, self.policy_extra = ckpt_ops.policy_sizes(spec, plan, tokens)
        self.half, self.l32, self.upcast = half, l32, half != l32
        self.g_in = tokens * spec.hidden_size * plan.precision.compute_bytes

    def slots(self) -> dict:
        named = {n: getattr(self, n) for n in ("residual", "pow", "half", "l32", "g_in")}
        return named | {f"t{i}": n for i, n in enumerate(self.table)} | self.tp


class _Skeleton:
    """`_PlanSizes` of a layout's stream: each size its slot's name (the table's `t0`, `t1` ...; the op-by-op
    layers' `request_stream_tp.slots`, `tokens` None)."""

    def __init__(self, n_table: int, upcast: bool, names: tuple, policy: tuple = (), extra: bool = False) -> None:
        self.residual, self.pow, self.half, self.l32, self.g_in = "residual", "pow", "half", "l32", "g_in"
        self.policy, self.policy_extra = list(policy), extra
        self.table = [f"t{i}" for i in range(n_table)]
        self.upcast, self.names, self.tokens = upcast, list(names), None


def program_requests(spec: ModelSpec, plan: TrainingPlan, sizes=None, repeat: bool = True) -> Requests:
    """Build, wrap and two iterations of the plan's program as requests (`sizes`: `_PlanSizes` of the plan, or a
    layout's `_Skeleton`; `repeat`: layers of one kind written from one record, `Requests.layer`)."""
    sizes = sizes or _PlanSizes(spec, plan)
    req = Requests(repeat)
    req.mark("build")
    params = model_order(spec)
    nbytes = plan.precision.param_bytes
    built = req.allocs([math.prod(p.shape) * nbytes for p in params])
    if spec.tie_word_embeddings:
        req.free(req.alloc(max(p.numel for p in spec.outer_params) * nbytes))
    if plan.tp > 1:
        built = _distribute(req, plan, params, built)
    if plan.scheme in FSDP_SCHEMES:
        return _fsdp_program(req, spec, plan, sizes, params, built)
    ddp = plan.scheme in (Scheme.DDP, Scheme.ZERO1)
    buckets = [req.alloc(sum(local_numel(p, plan) for p in params) * nbytes)] if ddp else []
    for iteration in (1, 2):
        req.mark(f"forward {iteration}")
        if ddp and iteration == 2:
            req.free(*buckets)
            buckets = req.allocs(rebuilt_bucket_bytes(spec, plan))
        saved = _forward(req, spec, plan, sizes)
        req.mark(f"loss {iteration}")
        grads = _backward(req, spec, plan, saved, sizes)
        req.mark(f"optimizer {iteration}")
        _step(req, spec, plan, iteration == 1)
        req.free(*grads)
    return req


def _distribute(req: Requests, plan: TrainingPlan, params: list, built: list[int]) -> list[int]:
    """TP's `parallelize_module`: each split parameter's local shard allocated (`distribute_tensor`: a row-wise
    weight's shard after two transposed copies of it, freed), then the full tensor freed; returns each parameter's
    key after it (its shard's, or its own)."""
    nbytes = plan.precision.param_bytes
    keys = []
    for p, key in zip(params, built, strict=True):
        if p.tp_split is TpSplit.NONE:
            keys.append(key)
            continue
        shard = math.prod(tp_local_shape(p, plan.tp)) * nbytes
        copies = [req.alloc(shard), req.alloc(shard)] if p.tp_split is TpSplit.ROWWISE and len(p.shape) >= 2 else []
        keys.append(req.alloc(shard))
        req.free(*reversed(copies), key)
    return keys


def _fsdp_program(req: Requests, spec: ModelSpec, plan: TrainingPlan, sizes, params: list,
                  built: list[int]) -> Requests:
    """FSDP2's wrap and two iterations (`request_stream_fsdp`); FSDP1's (`request_stream_fsdp1`)."""
    if fsdp1.applies(plan):
        return fsdp1.program(req, spec, plan, sizes, params, built, _step)
    fsdp.wrap(req, spec, plan, params, built)
    layers, root, _ = fsdp.groups(spec, plan, params)
    for iteration in (1, 2):
        req.mark(f"forward {iteration}")
        state = fsdp.forward(req, spec, plan, sizes, layers, root)
        req.mark(f"loss {iteration}")
        held = fsdp.backward(req, spec, plan, sizes, state, layers, root)
        req.mark(f"optimizer {iteration}")
        _step(req, spec, plan, iteration == 1)
        req.free(*held)
    return req


def rebuilt_bucket_bytes(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """`Reducer::rebuild_buckets`: `_compute_bucket_assignment_by_size` over the gradients in the order they became
    ready (last layer first), the first bucket closed at 1 MiB, the others at 25 MiB."""
    sizes, cur, cap = [], 0, FIRST_BUCKET_BYTES
    for p in reversed(model_order(spec)):
        cur += local_numel(p, plan) * plan.precision.param_bytes
        if cur >= cap:
            sizes.append(cur)
            cur, cap = 0, BUCKET_BYTES
    return sizes + ([cur] if cur else [])


def _copies(spec: ModelSpec, plan: TrainingPlan, layer: int) -> list[int]:
    """Autocast's half copies of a layer's Linear weights (none without autocast)."""
    if not autocast.applies(plan):
        return []
    half = plan.precision.compute_bytes
    return [local_numel(p, plan) * half for p in autocast._linear_weights(spec, layer)]


def _forward(req: Requests, spec: ModelSpec, plan: TrainingPlan, sizes: _PlanSizes) -> list[list[int]]:
    """The embedding output and each layer's kept tensors; returns the keys kept per layer (embedding first)."""
    kept = [[req.alloc(sizes.residual)]]
    if ckpt_ops.applies(plan):  # [[], each layer's input, [the last layer's output], autocast's cached weight copies]
        return ckpt_ops.forward(req, spec, plan, sizes.tokens, kept[0].pop(),
                                dict(zip(sizes.names, sizes.table, strict=True)))
    if per_op(plan):  # each layer's tensors by name, the last layer's output last
        return tp_forward.forward(req, spec, plan, dict(zip(sizes.names, sizes.table, strict=True)), kept[0].pop(),
                              sizes.tokens)
    for layer, kind in enumerate(layer_kinds(spec)):
        kept.append(req.layer(kind, _layer_forward, (), spec, plan, sizes, layer))
    return kept


def _layer_forward(req: Requests, _, spec: ModelSpec, plan: TrainingPlan, sizes: _PlanSizes, layer: int) -> list[int]:
    """A layer's weight copies, RMSNorm's fp32 pow (freed) and saved tensors; returns the keys kept."""
    keys = req.allocs(_copies(spec, plan, layer))
    req.free(req.alloc(sizes.pow))
    return keys + req.allocs(sizes.table)


def _backward(req: Requests, spec: ModelSpec, plan: TrainingPlan, kept: list[list[int]],
              sizes: _PlanSizes) -> list[int]:
    """Loss forward and backward, then the layers' backward; returns the keys freed at the end of the iteration:
    the logits (the model output, held by the loop through the step: `logits.logits_bytes`), then the gradients
    (`zero_grad`)."""
    half, l32 = sizes.half, sizes.l32
    mixed = autocast.applies(plan)
    cached = kept.pop() if ckpt_ops.applies(plan) else []
    head = autocast._head_weight_numel(spec, plan)
    copy = req.alloc(head * plan.precision.compute_bytes) if mixed else 0
    logits = req.alloc(half)
    upcast = req.alloc(l32) if sizes.upcast else 0
    lsm = req.alloc(l32)
    req.free(upcast)
    req.free(*cached)  # autocast's exit (`torch.autocast.__exit__` clears its cache) before `loss.backward()`
    g_nll = req.alloc(l32)
    g_lsm = req.alloc(l32)
    req.free(g_nll, lsm)
    g_half = req.alloc(half) if sizes.upcast else 0
    req.free(g_lsm)
    g_head = req.alloc(head * plan.precision.compute_bytes)
    g_in = req.alloc(sizes.g_in)
    req.free(g_half, copy)
    grads = [logits, req.alloc(head * plan.precision.param_bytes) if mixed else g_head]
    if mixed:
        req.free(g_head)
    if ckpt_ops.applies(plan):
        ckpt_ops.backward(req, spec, plan, kept, g_in, grads, dict(zip(sizes.names, sizes.table, strict=True)),
                          sizes.tokens)
    elif per_op(plan):
        tp_ops.backward(req, spec, plan, kept, g_in, grads, lambda r, n, cast: _gradient(r, n, cast, plan),
                        sizes.tokens)
    else:
        req.free(g_in)
        kinds = layer_kinds(spec)
        for layer in reversed(range(spec.num_layers)):
            grads += req.layer(kinds[layer], _layer_backward, kept[layer + 1], spec, plan, layer)
    req.free(*kept[0])
    embed = req.alloc(local_numel(spec.outer_params[0], plan) * plan.precision.param_bytes)  # TP: replicated
    if spec.tie_word_embeddings and not mixed:  # InputBuffer: the waiting lm_head gradient is a view (`.t()` of its
        head, grads[1] = grads[1], req.alloc(local_numel(spec.outer_params[0], plan) * plan.precision.param_bytes)
        req.free(head, embed)  # matmul's; one GPU, DDP and TP alike): `old + new`, a new sum (`tied_accumulation`)
    elif spec.tie_word_embeddings:  # autocast: a fresh `ToCopyBackward0` output, `old.add_(new)` in place
        req.free(embed)
    else:
        grads.append(embed)
    return grads


def _layer_backward(req: Requests, kept: list[int], spec: ModelSpec, plan: TrainingPlan, layer: int) -> list[int]:
    """Each parameter's gradient, last first, then the layer's kept tensors freed; returns the gradients' keys."""
    mixed = autocast.applies(plan)
    grads = [_gradient(req, local_numel(p, plan), len(p.shape) >= 2 and mixed, plan)
             for p in reversed(spec.layer_params(layer))]
    req.free(*reversed(kept))
    return grads


def _gradient(req: Requests, numel: int, cast: bool, plan: TrainingPlan) -> int:
    """A parameter's `.grad`: under autocast the half gradient, cast to fp32 (`ToCopyBackward0`), then freed."""
    if not cast:
        return req.alloc(numel * plan.precision.param_bytes)
    half = req.alloc(numel * plan.precision.compute_bytes)
    grad = req.alloc(numel * plan.precision.param_bytes)
    req.free(half)
    return grad


def _step(req: Requests, spec: ModelSpec, plan: TrainingPlan, first: bool) -> None:
    """Foreach AdamW, group by group: the states on the first step, then the one temporary list, freed."""
    for group in _group_bytes(spec, plan):
        if first:
            req.allocs([n for n in group for _ in (0, 1)])
        req.free(*req.allocs(group))
