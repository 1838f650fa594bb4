"""Links and command lines recorded with the code before the options table (tests/data/README.md) are read the same
today: the same inputs, re-encoded link, warnings, parsed arguments and plan."""

import json
from dataclasses import fields
from pathlib import Path

import pytest

from llmem.cli import build_parser, plan_from_args
from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.share import AppInputs, decode, encode

DATA = json.loads((Path(__file__).parent / "data" / "links_and_command_lines_v1.json").read_text())


@pytest.mark.parametrize("case", DATA["links"], ids=lambda c: ",".join(c["query"]) or "empty")
def test_old_links_decode_to_the_same_inputs(case):
    inputs, warnings = decode(case["query"])
    now = {f.name: str(getattr(inputs, f.name)) for f in fields(inputs)}
    if case["query"].get("quant") == "int8" and int(case["query"].get("gpus", 1)) > 1:
        # changed on purpose since the recording: the 8-bit base on several GPUs (DDP, ZeRO-1) is modelled now, so
        # the link keeps its method and quantization and only what still cannot go with them is repaired
        assert (now["method"], now["quant"]) == ("qlora", "int8"), now
        assert all(not w.startswith(("method:", "quant:")) for w in warnings), warnings
        inputs.to_plan()
        return
    if case["query"].get("lora-modules-to-save") and case["query"].get("zero") in ("2", "3"):
        # changed on purpose since the recording: PEFT's module copies under FSDP2 are modelled now
        # (llmem.components.lora_copies_fsdp), so the link keeps the copies it asked for instead of dropping them
        assert now["lora_modules_to_save"] == case["query"]["lora-modules-to-save"], now
        assert all(not w.startswith("lora-modules-to-save:") for w in warnings), warnings
        inputs.to_plan()
        return
    assert {k: now[k] for k in case["inputs"]} == case["inputs"]
    added = {f.name: str(f.default) for f in fields(AppInputs) if f.name not in case["inputs"]}
    assert {k: now[k] for k in added} == added  # options the old links could not carry keep their defaults
    assert encode(inputs) == case["encoded"]
    assert warnings == case["warnings"]


@pytest.mark.parametrize("case", DATA["command_lines"], ids=lambda c: " ".join(c["argv"][:1] + c["argv"][3:7]))
def test_old_command_lines_parse_to_the_same_arguments_and_plan(case):
    args = build_parser().parse_args(case["argv"])
    now = vars(args)
    assert {k: now[k] for k in case["args"]} == case["args"]
    assert all(type(now[k]) is type(v) for k, v in case["args"].items())
    try:
        plan = plan_from_args(args).to_dict()
    except InputError as err:
        plan = {"error": str(err)}
    given = dict(zip(case["argv"], case["argv"][1:], strict=False))
    if given.get("--optimizer-impl") == "fused" and int(given.get("--zero", 0)) >= 2:
        # changed on purpose since the recording: fused SGD cannot run on FSDP2's DTensor parameters (plan.py)
        assert plan.get("error", "").startswith("optimizer-impl:"), plan
        return
    assert {k: plan.get(k) for k in case["plan"]} == case["plan"]
    if "error" not in plan:  # options added since the recording keep their defaults
        defaults = TrainingPlan().to_dict()
        assert {k: v for k, v in plan.items() if k not in case["plan"]} == \
            {k: defaults[k] for k in plan if k not in case["plan"]}
