"""The simulated trace carries each allocation's stream, as the caching allocator sees it."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem.plan import TrainingPlan
from llmem.simulate import simulate
from llmem.simulate.tracker import AllocationTracker
from tests.measure.conftest import LLAMA

SMALL = dict(device="cpu", batch_size=2, seq_len=64, precision="fp32", optimizer_impl="forloop")


def test_tracker_records_the_current_stream():
    side = torch.cpu.Stream()
    with FakeTensorMode(), AllocationTracker() as t:
        a = torch.empty(1024)
        with torch.cpu.stream(side):
            b = torch.empty(2048)
        c = torch.empty(512)
    assert [blk.stream for blk in t.blocks] == [0, 1, 0]
    assert t.streams[1] is side
    del a, b, c


def test_fsdp2_allocates_on_its_all_gather_and_reduce_scatter_streams():
    """FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): `foreach_all_gather` allocates the
    all-gather buffers under `all_gather_copy_in_stream`, `foreach_reduce` the reduce-scatter output under
    `reduce_scatter_stream`; TP and DDP allocate on the default stream only."""
    fsdp = simulate(dict(LLAMA), TrainingPlan(**SMALL, gpus=2, zero=3))
    tp = simulate(dict(LLAMA), TrainingPlan(**SMALL, gpus=2, tp=2))
    assert fsdp.streams == 3 and tp.streams == 1
