"""The accuracy suite: every row of suite.yaml estimated and measured on CPU; 2% single-rank, 3% multi-rank."""

from pathlib import Path

from llmem.measure.validate import TOLERANCE_MULTI, TOLERANCE_SINGLE, load_suite, validate

SUITE = Path(__file__).with_name("suite.yaml")


def test_suite_covers_the_grid():
    suite = load_suite(SUITE)
    plans = [r.training_plan("cpu") for r in suite.rows]
    assert len(suite.rows) >= 30
    assert len({r.config["model_type"] for r in suite.rows}) >= 6
    assert {p.scheme.value for p in plans} == {"single", "ddp", "zero1", "zero2", "zero3", "tp", "tp+zero3"}
    assert {p.gpus for p in plans} == {1, 2, 4}
    assert {p.precision.value for p in plans} == {"fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"}
    assert {(p.optimizer.value, p.optimizer_impl.value) for p in plans} >= {
        ("adamw", "forloop"), ("adamw", "foreach"), ("adamw", "fused"), ("sgd", "forloop"), ("sgd", "foreach"),
        ("sgd", "fused")}
    assert {p.grad_ckpt.value for p in plans} == {"none", "full"} and {p.attn.value for p in plans} == {"sdpa", "eager"}


def test_estimates_within_tolerance(tmp_path):
    records = validate(SUITE, "cpu", tmp_path, accuracy_md=tmp_path / "ACCURACY.md", log=lambda _: None)
    assert (tmp_path / "validate.csv").exists() and (tmp_path / "ACCURACY.md").exists()
    failed = [f"{r['id']}: {r['message']}" for r in records if r["status"] in ("failed", "no estimate")]
    assert not failed, failed
    over = []
    for r in records:
        limit = 100 * (TOLERANCE_SINGLE if r["gpus"] == 1 else TOLERANCE_MULTI)
        if abs(r["error_pct"]) > limit:
            over.append(f"{r['id']}: {r['error_pct']:+.2f}% (estimate {r['estimated_bytes']}, "
                        f"measured {r['measured_bytes']})")
    assert not over, "\n".join(over)
