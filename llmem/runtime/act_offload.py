"""`--activation-offload`: torchtune 0.6.1's activation offloading, as its recipes apply it.

torchtune (BSD-3-Clause), `torchtune/training/_activation_offloading.py`:
  * `OffloadActivations` (:24-353), a `saved_tensors_hooks` with its defaults (:66-72): `use_pin_memory=True`,
    `use_streams=True`, `max_fwd_stash_size=5`, `min_offload_size=1024` bytes;
  * `NoOpManager` (:356-370), entered around the output projection by `get_act_offloading_ctx_manager(model, True)`
    (:373-449), which hooks `model.output` (:402-410): torchtune's name for the lm_head. A transformers model's
    output projection is `get_output_embeddings()`, hooked here the same way;
  * the recipes (`recipes/full_finetune_single_device.py:636`, `lora_finetune_single_device.py:643`) enter the
    manager around the model's forward only: `with self.activations_handling_ctx: logits = self._model(**batch)`;
    the loss is computed after it (`llmem.runtime.session`).
The class below is that program line for line (the pack and unpack hooks' order of stashing, copying, events and
deletions), with `torch.cuda` replaced by the device's module (`torch.get_device_module`), so that the simulation's
fake accelerator (`llmem.simulate.fake_cuda`) runs it as CUDA would. Left out: the psutil check of host memory use,
which only warns (:110-119, :244-247), and the NF4 error path (:174-182). `record_stream` (:322) is skipped on the
fake accelerator: it delays the reuse of a freed block, not the fall of `memory_allocated` (the CUDA caching
allocator lowers `allocated_bytes` in `DeviceCachingAllocator::free` before it looks at `stream_uses`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

MAX_FWD_STASH = 5  # OffloadActivations(max_fwd_stash_size=5)
MIN_OFFLOAD_BYTES = 1024  # OffloadActivations(min_offload_size=1024)


class OffloadActivations(saved_tensors_hooks):
    """torchtune's `OffloadActivations()` with its defaults, on `device` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.dev = torch.get_device_module(device.type)
        self.tracker: dict = {}  # tensor_id => (tensor, offloaded)
        self.tensor_id = 0
        self.is_first_forward_call = True
        self.is_first_backward_call = True
        self.s0 = self.dev.current_stream()  # :93 torch.cuda.default_stream()
        self.s1 = self.dev.Stream()  # :97
        self.fwd_stash: dict = {}  # tensor_id => (activation, event)
        self.bwd_tensor_stash: dict = {}
        self.bwd_ev_stash: dict = {}
        self.curr_graph_id = None
        self.curr_autograd_node = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        """`pack_tensor` (:133-200)."""
        if self.is_first_forward_call:
            assert not self.tracker, "backward pass should have cleared tracker of all tensors"
            self.is_first_forward_call = False
            self.is_first_backward_call = True
        num_bytes = activation.element_size() * activation.nelement()
        self.tensor_id += 1
        tensor_id = self.tensor_id
        if num_bytes >= MIN_OFFLOAD_BYTES and not isinstance(activation, (nn.Parameter, nn.Buffer)):
            for old in list(self.fwd_stash):
                if old <= tensor_id - MAX_FWD_STASH:
                    self.s0.wait_event(self.fwd_stash[old][1])
                    del self.fwd_stash[old]
                else:
                    break
            self.s1.wait_stream(self.s0)
            with self.dev.stream(self.s1):
                cpu_tensor = torch.empty_like(activation, pin_memory=True, device="cpu")
                cpu_tensor.copy_(activation, non_blocking=True)
                self.tracker[tensor_id] = (cpu_tensor, True)
            self.fwd_stash[tensor_id] = (activation, self.s1.record_event())
        else:
            self.tracker[tensor_id] = (activation, False)
        return tensor_id

    def _first_backward_call(self) -> None:
        """The first unpack of a backward (:230-250): the end-of-backward callback that drops the stash."""
        self.curr_graph_id = torch._C._current_graph_task_id()

        def wait_and_del_remaining_references() -> None:
            for old in list(self.bwd_tensor_stash):
                self.s1.wait_event(self.bwd_ev_stash[old])
                del self.bwd_tensor_stash[old]

        torch.autograd.variable.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)
        self.is_first_backward_call = False
        self.is_first_forward_call = True

    def _unpack(self, unpack_tensor_id: int) -> torch.Tensor:
        """`unpack_tensor_with_streams` (:227-346)."""
        if self.is_first_backward_call:
            self._first_backward_call()
        assert unpack_tensor_id in self.tracker, f"untracked tensor with id {unpack_tensor_id}"
        maybe_gpu_tensor, modified = self.tracker[unpack_tensor_id]
        if modified:
            graph_id = torch._C._current_graph_task_id()
            node = torch._C._current_autograd_node()
            prev_node_ids = []
            if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
                self.curr_autograd_node = node
                prev_node_ids = list(self.bwd_tensor_stash)
            brought_back_from_cpu = unpack_tensor_id not in self.fwd_stash
            storage_refcount = None
            if not brought_back_from_cpu:
                maybe_gpu_tensor = self.fwd_stash[unpack_tensor_id][0]
            else:
                with self.dev.stream(self.s1):
                    maybe_gpu_tensor = maybe_gpu_tensor.to(self.device, non_blocking=True)
                self.s0.wait_stream(self.s1)
                self.bwd_tensor_stash[unpack_tensor_id] = maybe_gpu_tensor
                storage_refcount = torch._C._storage_Use_Count(maybe_gpu_tensor.untyped_storage()._cdata)
            node.register_hook(self._node_hook(unpack_tensor_id, brought_back_from_cpu, storage_refcount,
                                               prev_node_ids))
        del self.tracker[unpack_tensor_id]
        return maybe_gpu_tensor

    def _node_hook(self, unpack_tensor_id: int, brought_back: bool, storage_refcount, prev_node_ids: list):
        """`hook(outputs, inputs)` (:301-340), run after the node that unpacked the tensor."""

        def hook(outputs, inputs):
            if brought_back:
                unpacked = self.bwd_tensor_stash[unpack_tensor_id]
                if torch._C._storage_Use_Count(unpacked.untyped_storage()._cdata) > storage_refcount:
                    if unpacked.device.type == "cuda":
                        unpacked.record_stream(self.s0)
                    del self.bwd_tensor_stash[unpack_tensor_id]
                else:
                    self.bwd_ev_stash[unpack_tensor_id] = self.s0.record_event()
            for old in list(self.fwd_stash):
                self.s0.wait_event(self.fwd_stash[old][1])
                del self.fwd_stash[old]
            for old in prev_node_ids:
                self.s1.wait_event(self.bwd_ev_stash[old])
                del self.bwd_tensor_stash[old]
            return outputs

        return hook


class NoOpManager(saved_tensors_hooks):
    """`NoOpManager` (:356-370): the innermost hooks win, so the output projection's saved tensors stay as they are."""

    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


def offloading_context(model: nn.Module, device: torch.device) -> OffloadActivations:
    """`get_act_offloading_ctx_manager(model, True)` (:393-418): the manager, and the output projection's forward
    wrapped in a NoOpManager by a pre-hook and an always-called forward hook."""
    manager = OffloadActivations(device)
    noop = NoOpManager()
    head = model.get_output_embeddings()
    head.register_forward_pre_hook(lambda *args: noop.__enter__())
    head.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)
    return manager
