"""DDP and ZeRO-1 under fake tensors (docs/SIMULATION.md): `DistributedDataParallel`'s `Reducer` and
`ZeroRedundancyOptimizer` do not run on fake tensors, so the unwrapped model runs as one rank does, the gradient
buckets come from the closed-form bucket assignment and the optimizer steps this rank's ZeRO-1 partition."""

from __future__ import annotations

from llmem.plan import Scheme

DDP_FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 << 20  # DistributedDataParallel(bucket_cap_mb=25)


class Buckets(list):
    """The live bucket blocks, with the capped sizes `rebuild_buckets` allocates (empty once rebuilt)."""

    rebuilt_sizes: list[int] = []


def zero1_partitions(params: list, world: int) -> list[list]:
    """`ZeroRedundancyOptimizer._partition_parameters` on the model's (fake) tensors: the estimate's partition."""
    from llmem.components.optimizer import greedy_partition

    return greedy_partition(params, world, lambda t: t.numel())


class PartitionOptimizer:
    """ZeRO-1 seen from one rank: the local optimizer steps this rank's partition; zero_grad clears every grad
    (ZeroRedundancyOptimizer's param_groups hold all parameters). The broadcast after the step is in place."""

    def __init__(self, local, all_params: list) -> None:
        self.local, self.all_params = local, all_params
        self.state = local.state

    def step(self):
        self.local.step()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.all_params:
            p.grad = None


def ddp_buckets(params: list) -> list[int]:
    """Bytes of each DDP gradient bucket (`Reducer::initialize_buckets` via `_compute_bucket_assignment_by_size`):
    parameters in reverse order, a bucket closes once it reaches its cap (1 MiB for the first, 25 MiB after)."""
    sizes, cur, cap = [], 0, DDP_FIRST_BUCKET_BYTES
    for p in reversed(params):
        cur += p.numel() * p.element_size()
        if cur >= cap:
            sizes.append(cur)
            cur, cap = 0, DDP_BUCKET_BYTES
    if cur:
        sizes.append(cur)
    return sizes


def install(session, plan, run_plan, rank: int | None, tracker, make_optimizer) -> tuple[list[int], int, list[str]]:
    """Add the closed-form buckets at wrap time and, for ZeRO-1, swap in the partition optimizer of the simulated
    rank (`rank`, or the one with the largest partition). Returns (bucket blocks, simulated rank, descriptions)."""
    params = [p for p in session.model.parameters() if p.requires_grad]
    tracker.module = "DistributedDataParallel"
    sizes = ddp_buckets(params)
    # at wrap one bucket holds every gradient: `_get_bucket_size_limits` (torch/nn/parallel/distributed.py) gives
    # `[sys.maxsize]` without find_unused_parameters; the capped buckets come with the rebuild (`rebuild_buckets`)
    total = sum(sizes)
    buckets = Buckets([tracker.add_block(total, "closed form: DDP gradient bucket", f"{total} B", closed_form=True)])
    buckets.rebuilt_sizes = sizes
    notes = [f"DDP gradient buckets: one of {total:,} B at wrap (Reducer::initialize_buckets, unbounded initial "
             f"assignment), rebuilt at the start of iteration 2's forward into {len(sizes)} (1 MiB first, 25 MiB "
             "after), old freed before new (Reducer::rebuild_buckets)"]
    sim_rank = rank or 0
    if plan.scheme is Scheme.ZERO1:
        parts = zero1_partitions(params, plan.dp)
        if rank is None:
            sim_rank = max(range(plan.dp), key=lambda r: (sum(p.numel() for p in parts[r]), -r))
        session.optimizer = PartitionOptimizer(make_optimizer(parts[sim_rank], run_plan), params)
        notes.append(f"ZeRO-1: ZeroRedundancyOptimizer's partition of rank {sim_rank} ({len(parts[sim_rank])} of "
                     f"{len(params)} tensors) stepped by a plain optimizer")
    tracker.module = ""
    return buckets, sim_rank, notes


def rebuild_buckets(tracker, buckets: list[int]) -> None:
    """`Reducer::rebuild_buckets` at the start of iteration 2's forward: `initialize_buckets` clears the old buckets
    before it allocates the new (reducer.cpp `buckets_.clear()`); no `.grad` views them (the simulation refuses
    `--ddp-bucket-view`), so they are freed first."""
    sizes, buckets.rebuilt_sizes = buckets.rebuilt_sizes, []
    if not sizes:  # rebuilt once (the first forward after a backward)
        return
    tracker.module = "DistributedDataParallel"
    for b in buckets:
        tracker.free_block(b)
    buckets[:] = [tracker.add_block(n, "closed form: DDP bucket rebuild", f"{n} B", closed_form=True)
                  for n in sizes]
    tracker.module = ""
