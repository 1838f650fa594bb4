"""The command line on an architecture outside the hand-written families: an estimate with the derived-tables note;
what the derivation does not cover is one line naming the field, exit code 2."""

import json

import pytest

from llmem.cli import main
from tests.derive.configs import config


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_estimate_of_an_unseen_family(tmp_path, capsys):
    code, out, err = run(capsys, "estimate", "--model", write(tmp_path, config("olmo2")), "--seq-len", "64",
                         "--gpu-type", "A100-80GB", "--json")
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result["model_type"] == "olmo2" and result["peak_bytes"] == sum(result["breakdown"].values())
    assert result["breakdown"]["activations"] > 0


@pytest.mark.parametrize("cfg, argv, field", [
    (config("stablelm"), ("--tp", "2", "--gpus", "2"), "tp"),  # no base_model_tp_plan in its config
    (config("qwen3_moe"), ("--method", "lora"), "lora-dropout"),  # all-linear: PEFT's ParamWrapper on the experts
    (config("olmo2"), ("--method", "qlora", "--quant", "int8", "--precision", "bf16", "--gpus", "2", "--zero", "3"),
     "quant"),  # FSDP2 drops the 8-bit weight's CB/SCB: the real program cannot run
    # qwen2_moe's dense layers among its expert ones under TP (its TP program traced as a derived one's)
    (config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=96, mlp_only_layers=[0]),
     ("--method", "lora", "--lora-targets", "q_proj,v_proj", "--tp", "2", "--gpus", "2"), "tp"),
    (config("jetmoe"), (), "num_local_experts"),  # experts not derived
    ({**config("olmo2"), "auto_map": {"AutoModelForCausalLM": "x.Y"}}, (), "model_type"),
])
def test_what_the_derivation_does_not_cover_is_refused_naming_the_field(tmp_path, capsys, cfg, argv, field):
    code, _, err = run(capsys, "estimate", "--model", write(tmp_path, cfg), "--seq-len", "64", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"llmem: error: {field}: "), err
