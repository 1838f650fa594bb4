"""`--activation-offload` in the sweep's draws (`llmem.sweep.act_offload`)."""

from llmem.estimate import estimate
from llmem.spec import ModelSpec
from llmem.sweep.draw import draw


def test_the_cuda_profile_draws_activation_offload_where_it_runs():
    """Seed 2's 600 full-size cuda plans: some with the option, on one GPU and on several (DDP and FSDP2), each
    accepted by the plan (one on one GPU and one under ZeRO-3 estimated); never on the cpu profile (torchtune's
    recipes refuse a CPU device)."""
    drawn = [d for d in draw(600, seed=2, size="full", device="cuda") if d.fields.get("activation_offload")]
    assert len(drawn) >= 10
    assert {d.fields["gpus"] > 1 for d in drawn} == {True, False}
    assert {d.fields["zero"] for d in drawn if d.fields["gpus"] > 1} >= {0, 3}
    for d in drawn:
        assert d.fields["grad_ckpt"] == "full" and d.fields["ckpt_every"] == 1 and d.plan().activation_offload
    for d in (drawn[0], next(d for d in drawn if d.fields["gpus"] > 1 and d.fields["zero"] == 3)):
        assert estimate(ModelSpec.from_config(dict(d.config)), d.plan()).peak_bytes > 0
    assert not any(d.fields.get("activation_offload") for d in draw(300, seed=2, size="small", device="cpu"))
