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
def no_packed_sequence_check(packed: bool = False):
    """transformers treats fake tensors as traced and would build an explicit float mask per layer; the
    packed-sequence check is what sends it there (position ids 0..s-1 are never packed). Under `--cp` (`packed`:
    a rank whose head-tail shard's positions jump, every rank of a cp group but the last) the real check finds
    packed sequences: the patch returns the sequence indices as `find_packed_sequence_indices` computes them
    (transformers 5.23 `masking_utils.py:771-773`), without its data-dependent `.all()`, and the real program's
    boolean mask follows."""
    import torch
    from transformers import masking_utils

    def indices(position_ids):
        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    orig = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = indices if packed else (lambda position_ids: None)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


@contextlib.contextmanager
def fake_parameter_conversion():
    """`Module._apply` (torch/nn/modules/module.py, torch 2.13) converts a fake parameter by
    `torch.utils.swap_tensors`, which refuses a tensor with a weak reference — and a fake parameter may have one
    (the fake-tensor converter's memo). A real CPU run converts the same parameter in place,
    `param.data = param_applied` (its `compute_should_use_set_data` path): done here too. PEFT's
    `_move_adapter_to_device_of_base_layer` (`adapter.to(device, dtype)`) needs it for LoRA adapters."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    orig = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            t1.data = t2.data
            return
        orig(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = orig


def preload_imports(plan: TrainingPlan) -> None:
    """Import PEFT and bitsandbytes before the fake mode starts: their modules make tensors at import time
    (bitsandbytes' NF4/FP4 code tables, PEFT's LoHa default scales), and `bnb.functional.quantize_blockwise`
    caches its 256-entry map on first use (`name2qmap["dynamic"]`). Made under the fake mode they would be fake
    for the rest of the process, and counted; in a real run they are made once per process (the dynamic map on the
    weights' device: the estimate counts it, `quant.process_map_bytes`, while this run leaves its 1,024 B out)."""
    if str(plan.method) != "full":
        import peft  # noqa: F401
        import peft.tuners.loha.layer  # noqa: F401
    if str(plan.method) == "qlora" or str(plan.optimizer) in ("adamw8bit", "paged-adamw8bit"):
        from bitsandbytes import functional

        # quantize_blockwise (double quant) caches its map on first use, reading values back with `.tolist()`
        if "dynamic" not in functional.name2qmap:
            functional.name2qmap["dynamic"] = functional.create_dynamic_map()


@contextlib.contextmanager
def bnb_optimizer(plan: TrainingPlan, fake_mode, tracker):
    """bitsandbytes' 8-bit optimizers (bitsandbytes 0.50, `bitsandbytes/optim/optimizer.py`) under fake tensors:
      * `Optimizer8bit.fill_qmap` builds the two 256-entry fp32 quantization maps in the constructor with
        `F.create_dynamic_map`, which reads values back (`.tolist()`): computed for real (host tensors), then made
        fake and counted where the constructor makes them, 2 × 1,024 B (on CUDA `init_state` copies them to the
        device at the first step; here they are live from the reset on);
      * cuda profile, `paged-adamw8bit`: `get_state_buffer` puts a state of a tensor with ≥ 1e5 elements in CUDA
        unified memory (`F.get_paged`), outside the caching allocator; fake tensors are CPU tensors, for which
        bitsandbytes falls back to `zeros_like`. The state is made untracked, as the allocator does not see it;
        `paged_bytes[0]` sums it.
    The update kernels (`bitsandbytes::optimizer_update_8bit_blockwise`, `optimizer_update_32bit`) have
    bitsandbytes' own fake implementations: in place, no allocation, as the CUDA kernels."""
    paged_bytes = [0]
    if str(plan.optimizer) not in ("adamw8bit", "paged-adamw8bit"):
        yield paged_bytes
        return
    from bitsandbytes.optim.optimizer import Optimizer8bit
    from torch.utils._python_dispatch import _disable_current_modes

    orig_fill, orig_buffer = Optimizer8bit.fill_qmap, Optimizer8bit.get_state_buffer

    def fill_qmap(self):
        with _disable_current_modes():
            orig_fill(self)
        for name, value in self.name2qmap.items():
            fake = fake_mode.from_tensor(value)
            tracker._track(fake.untyped_storage(), "create_dynamic_map", fake)
            self.name2qmap[name] = fake

    def get_state_buffer(self, p, dtype=None):
        if not (self.is_paged and plan.device is Device.CUDA and p.numel() >= 1e5):
            return orig_buffer(self, p, dtype=dtype)
        tracker.paused += 1
        try:
            buff = orig_buffer(self, p, dtype=dtype)
        finally:
            tracker.paused -= 1
        tracker.outside_allocator(buff.untyped_storage())
        paged_bytes[0] += buff.untyped_storage().nbytes()
        return buff

    Optimizer8bit.fill_qmap, Optimizer8bit.get_state_buffer = fill_qmap, get_state_buffer
    try:
        yield paged_bytes
    finally:
        Optimizer8bit.fill_qmap, Optimizer8bit.get_state_buffer = orig_fill, orig_buffer


@contextlib.contextmanager
def fake_deepcopy():
    """`copy.deepcopy` of a fake tensor (PEFT's `ModulesToSaveWrapper` deep-copies the module it saves):
    `Tensor.__deepcopy__` (torch/_tensor.py, torch 2.13) would copy the fake tensor's storage, which has no data
    (memory corruption). A real run's copy of a parameter is `Parameter(self.data.clone(), requires_grad)`
    (`Parameter.__deepcopy__`): the same clone, made under the fake mode (one allocation of the tensor's size)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    orig = torch.Tensor.__deepcopy__

    def deepcopy(self, memo):
        if not isinstance(self, FakeTensor):
            return orig(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone(memory_format=torch.preserve_format)
        if isinstance(self, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        memo[id(self)] = new
        return new

    torch.Tensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__ = orig


FALLBACK_LIMIT_BYTES = 512 << 20


@contextlib.contextmanager
def bounded_fallback(limit: int = FALLBACK_LIMIT_BYTES):
    """An op without a fake kernel makes FakeTensorMode run its real CPU kernel on zero-filled real copies of its
    tensor arguments (`torch/_subclasses/fake_tensor.py: run_fallback_kernel`, torch 2.13). At full size that is
    real host memory the size of the model (20.8 GB for a 7B plan's `_fused_sgd_` before its stand-in existed).
    Small arguments still take the fallback; above `limit` bytes the run stops with one line naming the op."""
    from torch._subclasses import fake_tensor

    orig = fake_tensor.run_fallback_kernel

    def run_fallback_kernel(fake_mode, func, flat_args, args_spec, error):
        size = sum(a.untyped_storage().nbytes() for a in flat_args if isinstance(a, fake_tensor.FakeTensor))
        if size > limit:
            raise RuntimeError(f"{func} has no fake kernel, and running the real one would copy {size:,} B of its "
                               "arguments into host memory; use estimate, or measure on a GPU") from None
        return orig(fake_mode, func, flat_args, args_spec, error)

    fake_tensor.run_fallback_kernel = run_fallback_kernel
    try:
        yield
    finally:
        fake_tensor.run_fallback_kernel = orig
