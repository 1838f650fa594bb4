"""The high end of reserved memory (`max_memory_reserved`): what PyTorch's CUDA caching allocator keeps for the
program DESIGN.md section 1 defines — the model built in full on the device (`from_config`), then wrapped, nothing
emptied — from the allocator's rules (c10/cuda/CUDACachingAllocator.cpp, torch 2.13; the rules that
llmem/simulate/allocator.py replays), without a trace: the parameters the build allocates, the FSDP2 buffers on
their own streams, and the walk's moments. The estimate's point figure (`point_bytes`) is the other end of the
range: a program that builds on the meta device or empties the cache after wrapping, replayed through the same
allocator model where the request stream covers the plan (else a flat allowance). The verdict uses the high end.

Three facts of the allocator carry the figure (docs/MODEL.md, "Reserved memory"):
  1. Segments are never given back during a step (`free_block` caches; nothing calls `empty_cache`), and
     `reset_peak_memory_stats` sets the reserved peak to the current reserved bytes. So everything the build
     allocated stays reserved: each parameter in the build dtype, in its own segment (`get_allocation_size`:
     >= 10 MiB rounded to 2 MiB; 1..10 MiB carved from 20 MiB segments; <= 1 MiB from 2 MiB small-pool
     segments), a tied lm_head's own weight (allocated by its `nn.Linear`, freed when tied), DDP's buckets.
     FSDP2 and TP shards are carved from those cached blocks (`build_cache_bytes`).
  2. Cached blocks serve only their own stream (`BlockComparatorSize`, `get_free_block`). FSDP2 allocates the
     all-gather output and input on `all_gather_copy_in_stream` (`foreach_all_gather`; two groups in flight with
     implicit prefetching) and each group's reduce-scatter output — the sharded gradients are views of it, alive
     until `zero_grad` — on `reduce_scatter_stream` (`foreach_reduce`): pools of their own (`side_stream_bytes`).
  3. On one stream, a freed block is reused by best fit for any request no larger than it. Tensors of one kind
     recur with the same sizes (every layer, every iteration), so each kind reuses its own blocks; tensors of
     another kind rarely fit them. The default stream then reserves the sum of each category's high-water over
     the iteration (`category_high_water`), or the build's segments if those are more — plus, under FSDP2, a
     segment for a request larger than every segment the build left (the root's reduce-scatter input: the
     unsharded gradients of embedding and lm_head in the reduce dtype), which no cached block can serve
     (`oversize_bytes`).
One GPU, DDP, ZeRO-1, TP (autocast, fp32) and FSDP2 of the plans `request_stream.replays` accepts take none of
these sums: the
program's own requests, tensor by tensor and each on its stream, are replayed through the allocator model instead
(default segments), which follows facts 2 and 3 where a category sum cannot (gradients carved from freed logits
blocks, states from freed activations, the order of the root's requests).
With `expandable_segments:True` a stream's one segment grows by pages at its end and every freed page serves any
later request of the stream (`try_allocate_expandable_block`), so the default stream reserves its allocated peak
(or the build's bytes) in 20 MiB pages, plus the side streams' pools.
"""

from __future__ import annotations

from llmem.components import Category, request_stream
from llmem.components import communication as comm
from llmem.components.sharding import FSDP_SCHEMES
from llmem.plan import Device, Engine, GradCkpt, Scheme, TrainingPlan
from llmem.spec import ModelSpec, per_spec

K_MIN_BLOCK = 512  # kMinBlockSize
K_SMALL_SIZE = 1 << 20  # kSmallSize
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer (also the large pool's page with expandable segments)
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
K_ROUND_LARGE = 2 << 20  # kRoundLarge


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def segment_bytes(nbytes: int) -> int:
    """`get_allocation_size(round_size(n))`: the segment a request of n bytes gets when nothing cached fits."""
    size = max(K_MIN_BLOCK, _up(nbytes, K_MIN_BLOCK))
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return _up(size, K_ROUND_LARGE)


@per_spec("layout_key")
def build_cache_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Segments the build (and DDP's wrap) leaves reserved at the peak reset, in registration order."""
    nbytes = plan.precision.param_bytes
    sizes = [p.numel * nbytes for i in range(spec.num_layers) for p in spec.layer_params(i)]
    sizes += [p.numel * nbytes for p in spec.outer_params]
    tied = segment_bytes(max(p.numel for p in spec.outer_params) * nbytes) if spec.tie_word_embeddings else 0
    large = small = 0
    free: list[int] = []  # remainders of the 20 MiB segments that 1..10 MiB requests split
    for n in sizes:
        size = max(K_MIN_BLOCK, _up(n, K_MIN_BLOCK))
        if size <= K_SMALL_SIZE:
            small += size
        elif size >= K_MIN_LARGE_ALLOC:
            large += _up(size, K_ROUND_LARGE)
        else:
            fits = [f for f in free if f >= size]
            if fits:
                free.remove(min(fits))
                rest = min(fits) - size
            else:
                large += K_LARGE_BUFFER
                rest = K_LARGE_BUFFER - size
            if rest > K_SMALL_SIZE:  # `should_split`
                free.append(rest)
    buckets = comm.ddp_bucket_bytes(spec, plan) if plan.scheme in (Scheme.DDP, Scheme.ZERO1) else 0
    # the tied lm_head's freed weight is the one cached block at wrap: DDP's buckets are carved from it first
    return large + _up(small, K_SMALL_BUFFER) + max(tied, _up(buckets, K_ROUND_LARGE))


@per_spec("layout_key")
def side_stream_bytes(spec: ModelSpec, plan: TrainingPlan, expandable: bool = False) -> int:
    """FSDP2's all-gather pool (the root's and a layer's output and input in flight together) and reduce-scatter
    pool (one output per group, reduce dtype, held until zero_grad); 0 for the other schemes."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    gather = [comm.root_unsharded_bytes(spec, plan), comm.all_gather_input_copy_bytes(spec, plan, True),
              comm.layer_unsharded_bytes(spec, plan), comm.all_gather_input_copy_bytes(spec, plan)]
    layer_out = comm.layer_reduce_scatter_input_bytes(spec, plan) // plan.dp
    root_out = comm.root_reduce_scatter_input_bytes(spec, plan) // plan.dp
    if expandable:
        pages = sum(max(K_MIN_BLOCK, _up(n, K_MIN_BLOCK)) for n in gather if n)
        return _up(pages, K_LARGE_BUFFER) + _up(spec.num_layers * layer_out + root_out, K_LARGE_BUFFER)
    reduce = spec.num_layers * segment_bytes(layer_out) if layer_out else 0
    return sum(segment_bytes(n) for n in gather if n) + reduce + (segment_bytes(root_out) if root_out else 0)


@per_spec("layout_key")
def oversize_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """FSDP2: segments for the default stream's requests larger than the largest segment of the build."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    largest = segment_bytes(max(p.numel for p in (*spec.outer_params, *spec.layer_params(0))) *
                            plan.precision.param_bytes)
    requests = (comm.root_reduce_scatter_input_bytes(spec, plan), comm.layer_reduce_scatter_input_bytes(spec, plan))
    return sum(segment_bytes(n) for n in requests if segment_bytes(n) > largest)


def category_high_water(phases, plan: TrainingPlan) -> int:
    """The sum over categories of each one's largest bytes over the walk's moments, on the default stream (FSDP2's
    sharded gradients live on the reduce-scatter stream)."""
    skip = Category.GRADIENTS if plan.scheme in FSDP_SCHEMES else None
    high: dict = {}
    for phase in phases:
        for cat, n in phase.breakdown.items():
            if cat is not skip and n > high.get(cat, 0):
                high[cat] = n
    return sum(high.values())


def reserved_bytes(spec: ModelSpec, plan: TrainingPlan, phases, peak, expandable: bool = False) -> int:
    """`max_memory_reserved` by the rules for the walk's `phases` (of `plan` on `spec`) whose largest is `peak` (a
    Phase); the peak itself on the CPU profile. Kept on the spec per plan, like the walk's phases."""
    if plan.device is not Device.CUDA:
        return peak.total
    return spec.memo(("reserved_bytes", plan.key, expandable),
                     lambda: _reserved_bytes(spec, plan, phases, peak, expandable), per_plan=True)


def _reserved_bytes(spec: ModelSpec, plan: TrainingPlan, phases, peak, expandable: bool) -> int:
    if not expandable and request_stream.replays(spec, plan):  # the tensors themselves through the allocator
        return request_stream.replayed_reserved_bytes(spec, plan)
    build = build_cache_bytes(spec, plan)
    side = side_stream_bytes(spec, plan, expandable)
    if expandable:
        on_side = peak.breakdown.get(Category.GRADIENTS, 0) if plan.scheme in FSDP_SCHEMES else 0
        return _up(max(build, peak.total - on_side), K_LARGE_BUFFER) + side
    return max(build + oversize_bytes(spec, plan), category_high_water(phases, plan), peak.total) + side


def point_replays(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether the point figure is the allocator model's replay (`point_bytes`): the plans the request stream covers
    (`request_stream.replays`; against `simulate`'s emptied-cache replay at full size every scheme reads within
    −2.9 … +4.7 %, the flat allowance −23.9 … +4.8 %: docs/notes/2026-11-28-point-replay-all.md), but full
    checkpointing outside FSDP1, which the checkpointing planner estimates at up to ~200 `--ckpt-every` K of one plan
    (each K its own stream: a replay per K took its search 0.19 → 2.0 s on llama-3.3-70b ZeRO-3, minutes on the
    4,096-layer benchmark model) and which keeps the flat allowance."""
    if not request_stream.replays(spec, plan):
        return False
    return plan.engine is Engine.FSDP1 or plan.grad_ckpt is not GradCkpt.FULL


def point_bytes(spec: ModelSpec, plan: TrainingPlan, peak) -> int:
    """The point figure of `max_memory_reserved` with default segments on CUDA: where `point_replays`, the allocator
    model's replay of the program with nothing of the build cached (`request_stream_point`), each request on its
    stream; for the others the peak plus the flat allowance (`outside.fragmentation_bytes`). `peak`: the walk's
    largest Phase."""
    from llmem.components import outside
    from llmem.components.request_stream_point import point_reserved_bytes

    if point_replays(spec, plan):
        return max(peak.total, point_reserved_bytes(spec, plan))
    return peak.total + outside.fragmentation_bytes(peak.total, plan)
