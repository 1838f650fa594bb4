"""`llmem.sweep.cp`: the sweep's `--cp` draws land on plans the support matrix accepts, over the families, methods,
checkpointing and accumulation cp is modelled with."""

from llmem.families import with_trait
from llmem.plan import TrainingPlan
from llmem.sweep.draw import draw


def test_cp_draws_are_accepted_plans_over_what_cp_is_modelled_with():
    drawn = [d for d in draw(600, 21) if d.fields.get("cp", 1) > 1]
    assert len(drawn) >= 20
    for d in drawn:
        plan = TrainingPlan(**d.fields)  # raises InputError on any refused or gap combination of options
        assert d.config["model_type"] in with_trait("context_parallel") and plan.seq_len % (2 * plan.cp) == 0
    assert {d.fields["method"] for d in drawn} == {"full", "lora"}
    assert {d.fields["grad_ckpt"] for d in drawn} == {"none", "full"}
    assert max(d.fields["grad_accum"] for d in drawn) > 1
    assert len({d.config["model_type"] for d in drawn}) >= 5
