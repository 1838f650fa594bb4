"""`--lora-adapter-dtype base` in the sweep's draws (`llmem.sweep.lora_dtype`)."""

from llmem.estimate import estimate
from llmem.spec import ModelSpec
from llmem.sweep import lora_dtype
from llmem.sweep.draw import draw


def test_the_cpu_profile_draws_base_dtype_adapters_where_they_run():
    """Seed 2's 600 small cpu plans: some LoRA plans set to a pure bf16 base with the adapters in bf16, on one GPU
    and on several, each accepted by the plan and estimated."""
    drawn = [d for d in draw(600, seed=2, size="small", device="cpu") if d.fields.get("lora_adapter_dtype")]
    assert len(drawn) >= 3
    assert {d.fields["gpus"] > 1 for d in drawn} == {True, False}
    for d in drawn:
        plan = d.plan()
        assert plan.method.value == "lora" and plan.precision.value == "bf16"
        assert estimate(ModelSpec.from_config(dict(d.config)), plan).peak_bytes > 0


def test_the_option_leaves_every_other_draw_as_it_was(monkeypatch):
    """Drawn from a stream of its own: with the share at 0 every plan is the same but for the option and the
    precision it sets."""
    with_option = draw(600, seed=2, size="small", device="cpu")
    monkeypatch.setattr(lora_dtype, "LORA_DTYPE_SHARE", 0.0)
    without = draw(600, seed=2, size="small", device="cpu")
    assert any(d.fields.get("lora_adapter_dtype") for d in with_option)
    for a, b in zip(with_option, without, strict=True):
        if a.fields.get("lora_adapter_dtype"):
            rest = {k: v for k, v in a.fields.items() if k != "lora_adapter_dtype"}
            assert rest | {"precision": b.fields["precision"]} == b.fields and a.fields["precision"] == "bf16"
        else:
            assert a.fields == b.fields
