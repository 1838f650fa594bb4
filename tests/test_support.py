"""The support matrix (`llmem.support.RULES`): every row refused by the plan's validation, with its message, blamed
option and kind, and repaired by a link; each condition reads only the fields its row names."""

import random
import re

import pytest

from llmem import support
from llmem.errors import GAP, REFUSED, InputError
from llmem.options import PLAN_OPTIONS
from llmem.plan import TrainingPlan
from llmem.share import KEYS, decode, encode

IDS = [f"{i}-{r.blame}-{r.kind}" for i, r in enumerate(support.RULES)]
# Links carry no device (the app estimates the cuda profile): these rows cannot arise from a link.
NOT_IN_LINKS = {i for i, r in enumerate(support.RULES) if "device" in r.fields}


def _pattern(rule: support.Rule) -> re.Pattern:
    parts = re.split(r"\{p\.[a-z_.]+\}", rule.message)
    return re.compile(re.escape(f"{rule.blame}: ") + ".+?".join(map(re.escape, parts)) + "$")


@pytest.mark.parametrize("rule", support.RULES, ids=IDS)
def test_every_row_is_what_the_plan_raises_for_its_example(rule):
    with pytest.raises(InputError) as e:
        TrainingPlan(**rule.example)
    assert e.value.field == rule.blame
    assert e.value.kind == rule.kind
    assert _pattern(rule).match(str(e.value)), str(e.value)


@pytest.mark.parametrize("rule", support.RULES, ids=IDS)
def test_the_example_trips_no_row_before_its_own(rule):
    plan = _Recorder(rule.example)
    tripped = [r for r in support.RULES if r.when(plan)]
    assert tripped and tripped[0] is rule


class _Recorder:
    """A plan's fields (the defaults, then `values`), recording which ones a condition reads."""

    def __init__(self, values: dict):
        self._values = {o.name: o.coercer(values.get(o.name, o.default)) for o in PLAN_OPTIONS}
        self.read: set[str] = set()

    def __getattr__(self, name):
        self.read.add(name)
        if name == "scheme":
            return TrainingPlan.scheme.func(self)  # the plan's own derivation, reading gpus, tp, zero and pp
        return self._values[name]


def _random_values(r: random.Random) -> dict:
    return {"gpus": r.choice([1, 2, 4, 8]), "tp": r.choice([1, 2]), "zero": r.choice([0, 1, 2, 3]),
            "method": r.choice(["full", "lora", "qlora"]), "quant": r.choice(["none", "nf4", "int8"]),
            "precision": r.choice(["bf16", "bf16-mixed", "fp32"]), "optimizer": r.choice(["adamw", "sgd", "adafactor",
                                                                                           "adamw8bit"]),
            "optimizer_impl": r.choice(["default", "foreach", "fused"]), "offload": r.choice(["none", "optimizer",
                                                                                           "optimizer+params"]),
            "loss": r.choice(["standard", "fused-linear-ce", "chunked-ce"]), "loss_chunks": r.choice([8, 4]),
            "device": r.choice(["cpu", "cuda"]),
            "grad_ckpt": r.choice(["none", "full"]), "ckpt_every": r.choice([1, 2]),
            "lora_modules_to_save": r.choice(["", "lm_head"]), "double_quant": r.choice([True, False]),
            "optimizer_in_backward": r.choice([True, False]), "keep_grads": r.choice([True, False]),
            "grad_accum": r.choice([1, 2]), "pp": r.choice([1, 1, 2]), "microbatches": r.choice([1, 2, 4]),
            "pp_schedule": r.choice(["1f1b", "gpipe"]), "batch_size": r.choice([1, 2, 4])}


def test_conditions_read_only_the_fields_their_row_names():
    r = random.Random(0)
    for _ in range(300):
        values = _random_values(r)
        for rule in support.RULES:
            plan = _Recorder(values)
            rule.when(plan)
            # the scheme reads pp first (`TrainingPlan.scheme`): a pipeline is a scheme of its own
            scheme = {"scheme", "pp"} if {"gpus", "tp", "zero"} <= set(rule.fields) else set()
            allowed = set(rule.fields) | scheme
            assert plan.read <= allowed, (rule.blame, plan.read - allowed)


@pytest.mark.parametrize("i,rule", [(i, r) for i, r in enumerate(support.RULES) if i not in NOT_IN_LINKS],
                         ids=[x for i, x in enumerate(IDS) if i not in NOT_IN_LINKS])
def test_link_repair_fixes_every_row(i, rule):
    """A link with the row's example opens on a plan that runs, with a warning naming the blamed option (or the
    method that fell back because of it)."""
    query = {KEYS[k]: str(v).lower() if isinstance(v, bool) else str(v) for k, v in rule.example.items()}
    inputs, warnings = decode(query)
    inputs.to_plan()
    assert any(w.startswith(f"{rule.blame}:") or f"({rule.blame}: " in w for w in warnings), warnings
    assert decode(encode(inputs))[1] == []


def test_device_rows_are_the_ones_links_cannot_carry():
    assert "device" not in KEYS
    assert {support.RULES[i].blame for i in NOT_IN_LINKS} == {"offload", "loss", "activation-offload"}


def test_rows_are_right_refusals_or_gaps():
    counts = support.counts()
    assert set(counts) == {REFUSED, GAP} and sum(counts.values()) == len(support.RULES)
    assert counts[GAP] > 0 and counts[REFUSED] > 0


def test_first_refusal_among_fields_skips_rows_reading_others():
    """gpus 3 with tp 2 trips the first row, which reads fields outside `among`: the optimizer row answers."""
    plan = _Recorder({"optimizer": "adafactor", "optimizer_impl": "fused", "gpus": 3, "tp": 2})
    assert support.first_refusal(plan).field == "tp"
    error = support.first_refusal(plan, among=("optimizer", "optimizer_impl"))
    assert error is not None and error.field == "optimizer-impl" and error.kind == REFUSED


def test_a_gap_says_so_on_the_error():
    with pytest.raises(InputError) as e:
        TrainingPlan(loss="fused-linear-ce", method="lora")
    assert e.value.gap and e.value.kind == GAP
    with pytest.raises(InputError) as e:
        TrainingPlan(loss="fused-linear-ce", device="cpu")
    assert not e.value.gap and e.value.kind == REFUSED
    with pytest.raises(InputError) as e:
        TrainingPlan(zero=7)
    assert e.value.kind == "input"


@pytest.mark.parametrize("model_type,plan,field,kind", [
    ("qwen3_moe", dict(method="lora", lora_targets="q_proj,gate", lora_dropout=0.0, gpus=2, tp=2), "tp",
     GAP),  # the router adapted under TP: not measured
    ("gpt2", dict(loss="fused-linear-ce", device="cuda"), "loss", REFUSED),  # Liger-Kernel has no gpt2 patch
    ("gpt2", dict(gpus=2, tp=2), "tp", REFUSED),  # its config carries no tensor-parallel plan
    ("gemma2", dict(loss="chunked-ce"), "loss", GAP),  # its forward softcaps the logits after the lm_head
    ("opt", dict(loss="chunked-ce"), "loss", GAP),  # its forward makes the lm_head's output .contiguous()
    ("gpt_neox", dict(loss="chunked-ce", gpus=2, tp=2), "loss", GAP),  # transformers' TP plan gathers the lm_head
])
def test_model_dependent_refusals_say_their_kind(model_type, plan, field, kind):
    from llmem.estimate import validate_plan_for_model
    from llmem.spec import ModelSpec

    with pytest.raises(InputError) as e:
        validate_plan_for_model(ModelSpec.from_config({"model_type": model_type}), TrainingPlan(**plan))
    assert (e.value.field, e.value.kind) == (field, kind)


SET = {"ckpt_every": 2, "lora_modules_to_save": "lm_head", "quant": "nf4", "double_quant": True, "loss_chunks": 4,
       "ds_reduce_bucket": 1000, "ds_overlap_comm": True, "pp_stages_per_rank": 3, "ds_prefetch_bucket": 1000,
       "ds_persistence_threshold": 1000, "no_sync": True}


@pytest.mark.parametrize("name", sorted(SET))
def test_an_option_the_link_repairs_without_its_need_is_a_row_of_the_matrix(name):
    """The options table's `Needs` with a repair (the app disables the widget, a link drops the value) and the
    support matrix agree: set without what it needs, the plan is refused by a row blaming it that reads both."""
    from llmem.options import BY_NAME

    option = BY_NAME[name]
    assert option.needs is not None and option.needs.repair
    with pytest.raises(InputError) as e:
        TrainingPlan(**{name: SET[name]})
    rows = [r for r in support.RULES if r.blame == option.key and {name, option.needs.attr} <= set(r.fields)]
    assert rows and e.value.field == option.key and e.value.kind == REFUSED


def test_every_option_the_link_repairs_is_checked():
    from llmem.options import LINK_OPTIONS

    assert {o.name for o in LINK_OPTIONS if o.needs is not None and o.needs.repair} == set(SET)
