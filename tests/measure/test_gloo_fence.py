"""The gloo fence: a collective returns only after gloo's worker thread has released the tensors it was given."""

import weakref

import pytest

from llmem.measure.gloo_fence import wait_released


class _Held:
    pass


def test_wait_released_returns_once_referents_are_gone():
    import threading
    import time

    obj = _Held()
    ref = weakref.ref(obj)
    holder = [obj]
    del obj

    def drop_later():
        time.sleep(0.05)
        holder.clear()

    threading.Thread(target=drop_later).start()
    wait_released([ref])
    assert ref() is None


def test_wait_released_times_out_with_a_clear_message():
    obj = _Held()
    with pytest.raises(RuntimeError, match="did not release"):
        wait_released([weakref.ref(obj)], timeout=0.05)


@pytest.mark.parametrize("gather_dim", [0, 2])
def test_fenced_functional_all_gather_is_the_functional_one(gather_dim):
    """DTensor's Shard -> Replicate (`funcol.all_gather_single`, the gathered lm_head's logits under TP) fenced: the
    same result and the same counted peak as the functional op, nothing of it alive once the caller drops its
    tensors, and the original back after the fence (a one-process gloo group)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from llmem.measure.counting import CountingTracker
    from llmem.measure.gloo_fence import fenced

    original = funcol.all_gather_single
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def run(fence: bool):
            with CountingTracker() as t:
                x = torch.randn(2, 64, 256)
                if fence:
                    with fenced(torch.nn.Module()):
                        y = funcol.all_gather_single(x, gather_dim, dist.group.WORLD)
                else:
                    y = funcol.all_gather_single(x, gather_dim, dist.group.WORLD)
                y = y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y
                same = torch.equal(y, x)
                del x, y
                left = t.ext.current()
            return same, t.peak_bytes_with_scratch, left

        plain, fenced_run = run(False), run(True)
    finally:
        dist.destroy_process_group()
    assert fenced_run[0] and plain[0]
    assert fenced_run[1] == plain[1] and fenced_run[2] == 0
    assert funcol.all_gather_single is original
