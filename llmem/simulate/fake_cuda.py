"""A fake accelerator for the plans whose memory is split between host and device (`--offload`).

The other runs use fake CPU tensors: where the program copies between host and device (`.cpu()`, `.to(device)`,
`pin_memory()`), a CPU "device" makes each copy a no-op and host and device memory one. Fake tensors on device
"cuda" exist on this CPU-only build, but the first differentiable op on one aborts the process: autograd records
each input's stream (`torch::autograd::InputMetadata`), which asks `c10::impl::getDeviceGuardImpl(CUDA)`, and a
CPU-only build registers none ("PyTorch is not linked with support for cuda devices").

So these runs use torch's Python backend for the PrivateUse1 device, renamed `simgpu`
(`torch.utils.backend_registration._setup_privateuseone_for_python_backend`): a device with a device guard, no
kernels and no memory, on which FakeTensorMode runs the same fake kernels as on CUDA. The runtime builds, wraps
and trains on `simgpu:0` as it would on `cuda:0`; the tracker counts `simgpu` storages as the device's (the caching
allocator's) and CPU storages on a ledger of their own (`AllocationTracker.host_*`). The backend module below is
what FSDP2 reaches through `_get_device_handle(device.type)` (`_fsdp_param_group.py:76,186`,
`_fsdp_collectives.py:335,445,576`, `_fsdp_state.py:116`, `_fsdp_init.py:222`): torch.cpu's streams and events
(`torch/cpu/__init__.py`), as the CPU-mesh ZeRO-2/3 runs already use, on one device, index 0. Stand-ins:
  * `Tensor.pin_memory()` (`_fsdp_param.py:315`, the sharded parameter): a new host tensor of the same size (the
    pinned copy; FakeTensorMode has no `_pin_memory`), and `is_pinned()`: whether the storage came from one;
  * the build: transformers probes the device context with `torch.tensor([])`
    (`modeling_utils.py: get_torch_context_manager_or_global_device`), and `torch.tensor` copies its data to the
    device below the Python dispatch (`internal_new_from_data`), i.e. a real kernel the backend does not have. The
    model is built on the host (fake CPU tensors, before the peak is reset), the method applied (PEFT's adapters
    follow their base layer's device), and moved to `simgpu:0`: the same parameters and buffers on the device as
    building there;
  * the device RNG state activation checkpointing saves (`torch/utils/checkpoint.py: get_device_states`): CUDA's
    is a 16-byte host tensor (`torch.cuda.get_rng_state`).
The rename is for the life of the process (torch cannot undo it); nothing else uses PrivateUse1 here.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_aten = torch.ops.aten
DEVICE = "simgpu"
CUDA_RNG_STATE_BYTES = 16  # torch.cuda.get_rng_state(): seed and offset of the Philox generator, a host ByteTensor


class _Backend:
    """`torch.simgpu`: what torch and FSDP2 ask of a device module (`torch/utils/backend_registration.py`:
    `_DummyBackendModule`), with torch.cpu's streams and events."""

    Stream, Event, StreamContext = torch.cpu.Stream, torch.cpu.Event, torch.cpu.StreamContext
    current_stream, stream, synchronize = staticmethod(torch.cpu.current_stream), staticmethod(torch.cpu.stream), \
        staticmethod(torch.cpu.synchronize)

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(_device) -> None:
        return None

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(_seed: int) -> None:
        return None

    @staticmethod
    def get_amp_supported_dtype() -> list:
        """Asked by `torch.amp.autocast(device_type)`, which activation checkpointing enters around its recompute
        (`torch/utils/checkpoint.py`); CUDA's half dtypes."""
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.empty(CUDA_RNG_STATE_BYTES, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(_state, device=None) -> None:
        return None


def uses_fake_device(plan) -> bool:
    """Plans simulated on the fake accelerator: the offloading ones, where host and device memory differ."""
    return str(plan.offload) != "none" or bool(getattr(plan, "activation_offload", False))


# Ops with CPU and CUDA kernels and a CompositeImplicitAutograd one for other backends (torch 2.13: found by asking
# the dispatcher for ops with a CPU kernel and a CompositeImplicitAutograd one; native_channel_shuffle aside).
# Without a PrivateUse1 kernel the dispatcher runs that decomposition on `simgpu` (silu_backward: sigmoid, 1 - s,
# x * (1 - s), 1 + ..., three products: five intermediates where CUDA's fused kernel makes only its output).
_FUSED_ON_CUDA = ("silu_backward", "mish_backward")
_LIBRARIES: list = []


def _never_runs(*args, **kwargs):
    raise RuntimeError("simgpu has no kernels: only fake tensors run on it")


def ensure_backend() -> None:
    """Register the `simgpu` backend once per process (module docstring), with a stand-in kernel for each of
    `_FUSED_ON_CUDA`, so that the op itself reaches FakeTensorMode (its meta kernel) as it would on CUDA."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    name = torch._C._get_privateuse1_backend_name()
    if name == DEVICE:
        return
    if name != "privateuseone":
        raise RuntimeError(f"the PrivateUse1 backend is already {name!r}; the offload simulation needs it")
    _setup_privateuseone_for_python_backend(rename=DEVICE, backend_module=_Backend())
    library = torch.library.Library("aten", "IMPL")
    for op in _FUSED_ON_CUDA:
        library.impl(op, _never_runs, "PrivateUse1")
    _LIBRARIES.append(library)


def stand_ins() -> dict:
    """The tracker's stand-ins for a fake-device run (`AllocationTracker.stand_ins`): the pinned copies."""
    pinned = weakref.WeakSet()

    def pin_memory(func, args, kwargs):
        with torch.no_grad():
            copy = args[0].clone(memory_format=torch.contiguous_format)
        pinned.add(copy.untyped_storage())
        return copy

    def is_pinned(func, args, kwargs):
        return args[0].device.type == "cpu" and args[0].untyped_storage() in pinned

    return {_aten._pin_memory.default: pin_memory, _aten.is_pinned.default: is_pinned}


def _moved(model, device):
    """`model` with every parameter and buffer on `device`, tied ones still tied. `Module.to` cannot: a fake
    parameter is converted by `param.data = ...` (`patches.fake_parameter_conversion`), which refuses a change of
    backend; a new Parameter of each tensor is what a build on the device holds."""
    done: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in done:
                        moved = t.to(device)
                        done[id(t)] = torch.nn.Parameter(moved, t.requires_grad) \
                            if isinstance(t, torch.nn.Parameter) else moved
                    table[name] = done[id(t)]
    return model


FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION


_CHOICES: dict = {}


def _cpu_choice(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> int:
    """The backend CPU's SDPA picks for tensors of these shapes (`_fused_sdp_choice_cpp`), asked once per layout
    with real empty tensors outside the fake modes (the fake op answers math whatever the shapes; an untouched
    empty tensor costs address space, not memory)."""
    from torch.utils._python_dispatch import _disable_current_modes

    tensors = (query, key, value, attn_mask)
    layout = tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in tensors)
    key_ = (layout, is_causal, scale, enable_gqa)
    if key_ not in _CHOICES:
        with _disable_current_modes():
            real = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in tensors]
            _CHOICES[key_] = int(torch.ops.aten._fused_sdp_choice.default(*real[:3], real[3], 0.0, is_causal,
                                                                          scale=scale, enable_gqa=enable_gqa))
    return _CHOICES[key_]


def _sdpa(orig):
    """`F.scaled_dot_product_attention` on the fake device: the kernel the CPU-profile runs take. SDPA picks its
    kernel by device (`_fused_sdp_choice_stub`, registered for CPU and CUDA only), so on PrivateUse1 it would run
    the math path (an fp32 softmax of the scores); the flash kernel it takes on CPU saves the output and an fp32
    logsumexp per query and head, as CUDA's flash kernel does. Dropout is left to the fused kernel
    (`patches.cuda_kernel_choices`)."""
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        if query.device.type != DEVICE or _cpu_choice(query, key, value, attn_mask, is_causal, scale,
                                                      enable_gqa) != FLASH:
            return orig(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    return scaled_dot_product_attention


@contextlib.contextmanager
def fake_device(plan, tracker):
    """While an offloading plan runs: the tracker counts `simgpu` storages as the device's, host ones apart."""
    if not uses_fake_device(plan):
        yield
        return
    from torch.nn import functional

    from llmem.runtime import session

    ensure_backend()
    tracker.device_type = DEVICE
    tracker.stand_ins.update(stand_ins())
    orig = session.build_model, session.apply_method, functional.scaled_dot_product_attention
    devices: list = []

    def build_model(config, plan, device="cpu"):
        devices.append(device)
        return orig[0](config, plan, "cpu")

    def apply_method(model, plan):
        return _moved(orig[1](model, plan), devices.pop())

    session.build_model, session.apply_method = build_model, apply_method
    functional.scaled_dot_product_attention = _sdpa(orig[2])
    try:
        yield
    finally:
        session.build_model, session.apply_method, functional.scaled_dot_product_attention = orig
