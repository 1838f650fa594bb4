"""The GPU catalog: one row per GPU type, with its memory capacity and where that figure comes from.

`memory_bytes` is the capacity the vendor states on its product page or datasheet. GPU vendors write "GB" for
memory that is built from power-of-two DRAM/HBM parts, so "80GB" means 80 GiB = 80 × 2**30 bytes; every `source`
says which unit the vendor used and how it was converted. The driver keeps a little of that for itself (ECC,
firmware): e.g. `nvidia-smi` shows 81,920 MiB total on an A100 80GB and PyTorch reports 79.15 GiB total
capacity. The estimate counts the CUDA context separately (`device_total_bytes`), so treat a verdict with
under ~1 GiB of headroom as marginal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmem.errors import InputError

GIB = 1 << 30


@dataclass(frozen=True)
class GpuType:
    """One GPU model: `key` is the stable spelling used in URLs and on the command line."""

    key: str
    name: str
    memory_bytes: int
    source: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.key):
            raise ValueError(f"key: {self.key!r} must be lower-case letters, digits and hyphens")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes: must be a positive int, got {self.memory_bytes!r}")

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def _binary_gb(n: int, url: str, stated: str) -> str:
    return f"{url} — vendor states {stated}; GPU-memory GB is binary, so {n} × 2^30 bytes"


_CATALOG: tuple[GpuType, ...] = (
    GpuType("t4", "NVIDIA T4 16GB", 16 * GIB,
            _binary_gb(16, "https://www.nvidia.com/en-us/data-center/tesla-t4/", "16 GB GDDR6")),
    GpuType("v100-16gb", "NVIDIA V100 16GB", 16 * GIB,
            _binary_gb(16, "https://www.nvidia.com/en-us/data-center/v100/", "16 GB HBM2")),
    GpuType("v100-32gb", "NVIDIA V100 32GB", 32 * GIB,
            _binary_gb(32, "https://www.nvidia.com/en-us/data-center/v100/", "32 GB HBM2")),
    GpuType("a10g", "NVIDIA A10G 24GB (AWS G5)", 24 * GIB,
            _binary_gb(24, "https://aws.amazon.com/ec2/instance-types/g5/", "24 GiB per GPU")),
    GpuType("l4", "NVIDIA L4 24GB", 24 * GIB,
            _binary_gb(24, "https://www.nvidia.com/en-us/data-center/l4/", "24GB GDDR6")),
    GpuType("rtx-3090", "NVIDIA GeForce RTX 3090 24GB", 24 * GIB,
            _binary_gb(24, "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/",
                       "24 GB GDDR6X")),
    GpuType("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 24 * GIB,
            _binary_gb(24, "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/",
                       "24 GB GDDR6X")),
    GpuType("l40s", "NVIDIA L40S 48GB", 48 * GIB,
            _binary_gb(48, "https://www.nvidia.com/en-us/data-center/l40s/", "48GB GDDR6 with ECC")),
    GpuType("a100-40gb", "NVIDIA A100 40GB", 40 * GIB,
            _binary_gb(40, "https://www.nvidia.com/en-us/data-center/a100/", "40GB HBM2")),
    GpuType("a100-80gb", "NVIDIA A100 80GB", 80 * GIB,
            _binary_gb(80, "https://www.nvidia.com/en-us/data-center/a100/", "80GB HBM2e")),
    GpuType("h100-pcie", "NVIDIA H100 PCIe 80GB", 80 * GIB,
            _binary_gb(80, "https://www.nvidia.com/en-us/data-center/h100/", "80GB (H100 PCIe)")),
    GpuType("h100-sxm", "NVIDIA H100 SXM 80GB", 80 * GIB,
            _binary_gb(80, "https://www.nvidia.com/en-us/data-center/h100/", "80GB HBM3 (H100 SXM)")),
    GpuType("h200", "NVIDIA H200 141GB", 141 * GIB,
            _binary_gb(141, "https://www.nvidia.com/en-us/data-center/h200/", "141GB HBM3e")),
    GpuType("b200", "NVIDIA B200 180GB", 180 * GIB,
            _binary_gb(180, "https://www.nvidia.com/en-us/data-center/dgx-b200/",
                       "1,440GB HBM3e for 8 GPUs = 180GB per GPU")),
    GpuType("mi300x", "AMD Instinct MI300X 192GB", 192 * GIB,
            _binary_gb(192, "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
                       "192 GB HBM3")),
)

_BY_KEY = {g.key: g for g in _CATALOG}
# Extra spellings people type; the key itself, the name and the loose forms of both are always accepted.
_ALIASES = {
    "v100": "v100-32gb",
    "a100": "a100-80gb",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "a10": "a10g",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
}


def _loose(text: str) -> str:
    """Lower-case with spaces, hyphens, underscores and the vendor words removed: "NVIDIA A100 80GB" → "a10080gb"."""
    text = text.lower()
    for word in ("nvidia", "amd", "geforce", "instinct", "tesla"):
        text = text.replace(word, "")
    return re.sub(r"[\s_\-()]+", "", text)


_LOOKUP: dict[str, GpuType] = {}
for _g in _CATALOG:
    _LOOKUP[_loose(_g.key)] = _g
    _LOOKUP[_loose(_g.name)] = _g
for _alias, _key in _ALIASES.items():
    _LOOKUP.setdefault(_loose(_alias), _BY_KEY[_key])


def list_gpus() -> list[GpuType]:
    """Every GPU in the catalog, smallest memory first (stable order for menus)."""
    return sorted(_CATALOG, key=lambda g: (g.memory_bytes, g.key))


def get_gpu(key_or_name: str) -> GpuType:
    """The catalog entry for a key ("a100-80gb"), a name ("NVIDIA A100 80GB") or a common alias ("a100")."""
    if isinstance(key_or_name, GpuType):
        return key_or_name
    text = str(key_or_name).strip()
    found = _LOOKUP.get(_loose(text)) if text else None
    if found is None:
        keys = ", ".join(g.key for g in list_gpus())
        raise InputError("gpu-type", f"{str(key_or_name)[:60]!r} is not in the GPU catalog; choose one of: {keys}")
    return found
