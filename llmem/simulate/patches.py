"""Patches active only while simulating (docs/SIMULATION.md, "Patches active only while simulating"); nothing in
`llmem/runtime` changes. Each is a context manager that restores what it replaced."""

from __future__ import annotations

import contextlib

from llmem.plan import Device, TrainingPlan


@contextlib.contextmanager
def real_device_mesh():
    """Device meshes compute their rank map and coordinates with tensor ops and read them back (`tolist`,
    `nonzero`): build them outside the fake and tracking modes (the runtime's `wrap` and FSDP2's TP x FSDP2
    sharding build them; these patches are only active while simulating)."""
    from torch.distributed import device_mesh
    from torch.utils._python_dispatch import _disable_current_modes

    orig_init_mesh, orig_init = device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__

    def init_device_mesh(*args, **kwargs):
        with _disable_current_modes():
            return orig_init_mesh(*args, **kwargs)

    def init(self, *args, **kwargs):
        with _disable_current_modes():
            orig_init(self, *args, **kwargs)

    device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = init_device_mesh, init
    try:
        yield
    finally:
        device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = orig_init_mesh, orig_init


@contextlib.contextmanager
def untracked_sharding_propagation(tracker):
    """DTensor's sharding propagation builds fake copies of its arguments to infer output metadata
    (`OpSchema.gen_fake_args`); a real run makes them under its own fake mode, never on the device."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, *args, **kwargs):
        tracker.paused += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            tracker.paused -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig


@contextlib.contextmanager
def cuda_kernel_choices(plan: TrainingPlan):
    """On the cuda profile, take the branches CUDA takes where CPU code paths differ in memory:
      * `F.dropout`: `at::native::dropout` runs the fused `native_dropout` (bool mask saved) only on CUDA; on
        CPU `_dropout_impl` saves a noise tensor in the input's dtype;
      * `F.scaled_dot_product_attention` with dropout: CUDA's flash / memory-efficient kernels apply dropout
        inside (philox seed and offset only); the CPU flash kernel refuses dropout and the math path would run.
        The simulation calls it with dropout_p = 0, which allocates what the fused kernels do."""
    if plan.device is not Device.CUDA:
        yield
        return
    import torch
    from torch.nn import functional

    orig_dropout, orig_sdpa = functional.dropout, functional.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        if inplace or not training or p == 0 or input.numel() == 0:
            return orig_dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return orig_sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    functional.dropout, functional.scaled_dot_product_attention = dropout, scaled_dot_product_attention
    try:
        yield
    finally:
        functional.dropout, functional.scaled_dot_product_attention = orig_dropout, orig_sdpa


@contextlib.contextmanager
def no_packed_sequence_check():
    """transformers treats fake tensors as traced and would build an explicit float mask per layer; the
    packed-sequence check is what sends it there (position ids 0..s-1 are never packed)."""
    from transformers import masking_utils

    orig = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig
