"""`llmem.measure.schemes`: ACCURACY.md's per-scheme table."""

from llmem.measure.schemes import scheme_summary


def test_every_row_of_the_committed_table_is_in_one_scheme_group():
    """ACCURACY.md's per-scheme table counts each configuration once: torch's programs by scheme, FSDP1's and
    DeepSpeed's apart (their rows were left out of it before)."""
    records = [{"scheme": s, "engine": e, "zero": z, "error_pct": 0.1, "status": "ok"} for s, e, z in [
        ("single", "torch", "0"), ("ddp", "fsdp1", "0"), ("zero3", "fsdp1", "3"), ("single", "deepspeed", "2"),
        ("zero2", "deepspeed", "2"), ("zero3", "deepspeed", "3"), ("tp+zero3", "torch", "3"), ("pp", "torch", "0")]]
    groups = scheme_summary(records)
    assert sum(g["rows"] for g in groups) == len(records)
    assert [g["label"] for g in groups if g["scheme"].startswith("deepspeed")] == \
        ["ZeRO-2 (DeepSpeed)", "ZeRO-3 (DeepSpeed)"]
