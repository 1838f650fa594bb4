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
