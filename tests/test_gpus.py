"""The GPU catalog: required entries, exact capacities, lookup and the error for unknown names."""

import pytest

from llmem.errors import InputError
from llmem.gpus import GIB, GpuType, get_gpu, list_gpus

REQUIRED = {
    "v100-16gb": 16, "v100-32gb": 32, "t4": 16, "a10g": 24, "l4": 24, "l40s": 48, "rtx-3090": 24,
    "rtx-4090": 24, "a100-40gb": 40, "a100-80gb": 80, "h100-sxm": 80, "h100-pcie": 80, "h200": 141,
    "b200": 180, "mi300x": 192,
}


def test_required_gpus_with_exact_capacity():
    catalog = {g.key: g for g in list_gpus()}
    for key, gib in REQUIRED.items():
        assert catalog[key].memory_bytes == gib * GIB, key
    assert get_gpu("h100-sxm").memory_bytes == 85_899_345_920


def test_every_entry_is_well_formed():
    gpus = list_gpus()
    assert len({g.key for g in gpus}) == len(gpus)
    assert len({g.name for g in gpus}) == len(gpus)
    for g in gpus:
        assert isinstance(g.memory_bytes, int) and g.memory_bytes > 0
        assert g.source.startswith("https://"), g.key
        assert "GB" in g.source and "2^30" in g.source, "source must say which unit the vendor used"
        assert get_gpu(g.key) is g and get_gpu(g.name) is g
    assert [g.memory_bytes for g in gpus] == sorted(g.memory_bytes for g in gpus)


@pytest.mark.parametrize("spelling, key", [
    ("A100-80GB", "a100-80gb"), ("nvidia a100 80gb", "a100-80gb"), (" H100 ", "h100-sxm"),
    ("RTX 4090", "rtx-4090"), ("MI300X", "mi300x"), ("a100_40gb", "a100-40gb"),
])
def test_lookup_is_forgiving(spelling, key):
    assert get_gpu(spelling).key == key


@pytest.mark.parametrize("bad", ["", "a100-81gb", "tpu-v5", "../etc/passwd", "x" * 500])
def test_unknown_gpu_names_the_field_and_the_choices(bad):
    with pytest.raises(InputError) as err:
        get_gpu(bad)
    assert err.value.field == "gpu-type"
    assert "a100-80gb" in str(err.value) and "choose one of" in str(err.value)
    assert len(str(err.value)) < 400


def test_gpu_type_is_frozen_and_validated():
    g = get_gpu("t4")
    with pytest.raises(AttributeError):
        g.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="memory_bytes"):
        GpuType("x", "X", 0, "https://example.com")
    with pytest.raises(ValueError, match="key"):
        GpuType("Bad Key", "X", 1, "https://example.com")
