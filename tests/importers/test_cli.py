"""`--from` on estimate, compare and plan-ckpt: files fill what the flags leave, the report comes first (or joins the
JSON), errors are one line naming the file and key, exit code 2."""

import json

import pytest

from llmem.cli import main

from .conftest import CONFIGS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cfg(name: str) -> str:
    return str(CONFIGS / name)


def test_estimate_prints_the_report_then_the_estimate(capsys):
    code, out, _ = run(capsys, "estimate", "--from", cfg("sft_config.yaml"), "--from", cfg("ds_z3_offload.json"),
                       "--gpus", "8", "--batch-size", "1", "--engine", "torch")
    assert code == 0
    assert out.index("read sft_config.yaml") < out.index("per-GPU peak")
    assert "qwen2.5-7b" in out and "ZeRO-3 (FSDP2, reshard after forward) on 8 GPU(s), micro-batch 1 × 4096" in out
    assert "overridden by --batch-size on the command line" in out


def test_deepspeed_zero2_is_estimated_as_deepspeeds_own_program(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--from", cfg("ds_z2_numeric.json"), "--grad-accum", "1")
    assert code == 0 and "--engine deepspeed" in out and "ZeRO-2 (DeepSpeed) on 8 GPU(s)" in out
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--from", cfg("ds_z2_numeric.json"))
    assert code == 0 and "ZeRO-2 (DeepSpeed) on 8 GPU(s)" in out  # its gradient_accumulation_steps 2, modelled
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--from", cfg("ds_z2_numeric.json"), "--zero", "1")
    assert code == 0 and "ZeRO-1 (DeepSpeed) on 8 GPU(s)" in out  # overlap_comm with accumulation, modelled
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--from", cfg("ds_z2_numeric.json"), "--keep-grads")
    assert code == 2 and "under DeepSpeed are not modelled" in err and "ds_z2_numeric.json" in err


def test_an_auto_reduce_bucket_is_the_models_hidden_size_squared(capsys, tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}')
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--gpus", "2", "--from", str(tmp_path / "ds.json"),
                       "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"]["ds_reduce_bucket"] == 768 ** 2 and data["plan"]["engine"] == "deepspeed"


def test_json_carries_the_import(capsys):
    code, out, _ = run(capsys, "estimate", "--from", cfg("adapter_config.json"), "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"]["method"] == "lora" and data["plan"]["lora_rank"] == 16
    assert data["import"]["options"]["model"] == "llama-3.1-8b"


@pytest.mark.parametrize("command", ["compare", "plan-ckpt"])
def test_compare_and_plan_ckpt_take_files(capsys, command):
    code, out, _ = run(capsys, command, "--from", cfg("accelerate_fsdp2.yaml"), "--model", "gpt2", "--json")
    assert code in (0, 1) and json.loads(out)["import"]["options"]["gpus"] == 8


@pytest.mark.parametrize("argv, start", [
    (["--from", cfg("ds_z3_offload.json")], "llmem: error: arguments: the following arguments are required: --model"),
    (["--model", "gpt2", "--from", "training_args.bin"], "llmem: error: --from training_args.bin: "),
    (["--model", "gpt2", "--engine", "torch", "--from", cfg("ds_z3_offload.json")],
     "llmem: error: zero: ZeRO shards across GPUs"),
])
def test_errors_are_one_line(capsys, tmp_path, argv, start):
    (tmp_path / "training_args.bin").write_bytes(b"\x80\x04junk")
    argv = [str(tmp_path / a) if a == "training_args.bin" else a for a in argv]
    code, _, err = run(capsys, "estimate", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.replace(str(tmp_path) + "/", "").startswith(start)


def test_a_file_value_the_plan_refuses_names_its_key(capsys):
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--engine", "torch", "--from",
                       cfg("ds_z3_offload.json"))
    assert code == 2 and "(zero set by ds_z3_offload.json: zero_optimization.stage)" in err


def test_without_from_nothing_changes(capsys):
    code, _, err = run(capsys, "estimate")
    assert code == 2 and err == "llmem: error: arguments: the following arguments are required: --model\n"


@pytest.mark.parametrize("flag", [["--batch-size=1"], ["--batch-size", "1"], ["--batch", "1"]])
def test_a_flag_in_any_spelling_overrides_the_files(capsys, flag):
    code, out, _ = run(capsys, "estimate", "--from", cfg("sft_config.yaml"), *flag, "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"]["batch_size"] == 1 and data["plan"]["grad_accum"] == 8
    assert "batch_size" not in data["import"]["options"]
