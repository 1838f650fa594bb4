"""The command line through a subprocess, as users' scripts call it (DESIGN.md section 3)."""

import csv
import json
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmem", *args], capture_output=True, text=True, timeout=120)


def test_estimate_json_has_the_contract_fields():
    out = run("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--zero", "3", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("peak_bytes", "peak_phase", "breakdown", "total_params", "trainable_params", "reserved_bytes",
                "device_total_bytes"):
        assert key in data
    assert sum(data["breakdown"].values()) == data["peak_bytes"]
    assert data["total_params"] == 8_030_261_248
    assert data["device_total_bytes"] >= data["reserved_bytes"] >= data["peak_bytes"]


def test_estimate_human_output_names_phase_and_verdict():
    out = run("estimate", "--model", "qwen2.5-0.5b", "--gpu-type", "a100-80gb")
    assert out.returncode == 0, out.stderr
    assert "GiB" in out.stdout and "verdict: fits" in out.stdout and "peak" in out.stdout


def test_compare_writes_the_csv(tmp_path):
    path = tmp_path / "cmp.csv"
    out = run("compare", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-type", "a100-80gb", "--csv", str(path))
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 7
    assert sum(r["recommended"] == "True" for r in rows) == 1


@pytest.mark.parametrize(
    "args,field",
    [
        (["--model", "llama-3.1-8b", "--batch-size", "0"], "batch-size"),
        (["--model", "llama-3.1-8b", "--batch-size", "-4"], "batch-size"),
        (["--model", "llama-3.1-8b", "--gpus", "4", "--tp", "3"], "tp"),
        (["--model", "llama-3.1-8b", "--gpus", "6", "--tp", "6"], "tp"),
        (["--model", "llama-3.1-8b", "--precision", "int3"], "precision"),
        (["--model", "no-such-model"], "model"),
        (["--model", "llama-3.1-8b", "--gpu-type", "tpu-v9"], "gpu-type"),
        (["--model", "llama-3.1-8b", "--ckpt-every", "2"], "ckpt-every"),
        (["--model", "llama-3.1-8b", "--grad-ckpt", "full", "--ckpt-every", "0"], "ckpt-every"),
        (["--model", "llama-3.1-8b", "--method", "lora", "--lora-modules-to-save", "lm_haed"], "lora-modules-to-save"),
        (["--model", "qwen2.5-0.5b", "--method", "lora", "--lora-modules-to-save", "norm"], "lora-modules-to-save"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(args, field):
    out = run("estimate", *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0
    assert field in out.stderr


def test_malformed_and_unknown_configs(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    out = run("estimate", "--model", str(bad))
    assert out.returncode == 2 and "JSON" in out.stderr and "Traceback" not in out.stderr
    bad.write_text('{"model_type": "t5", "d_model": 512}')
    out = run("estimate", "--model", str(bad))
    assert out.returncode == 2 and "model_type" in out.stderr


def test_compare_methods_adds_rows_and_rejects_unknown_names():
    out = run("compare", "--model", "llama-3.2-1b-instruct", "--gpus", "4", "--methods", "lora", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    lora = [r for r in rows if r["method"] == "lora"]  # LoRA runs on the 4 GPUs: DDP, ZeRO-1, FSDP2 ZeRO-2/3
    assert rows[-1]["method"] == "lora" and {r["gpus"] for r in lora} == {4} and len(lora) == 4
    bad = run("compare", "--model", "llama-3.2-1b-instruct", "--methods", "dora")
    assert bad.returncode == 2 and "methods" in bad.stderr and "dora" in bad.stderr and "Traceback" not in bad.stderr


def test_compare_methods_shows_qlora_under_ddp_zero1_and_fsdp2():
    out = run("compare", "--model", "llama-3.2-1b-instruct", "--gpus", "4", "--zero", "3", "--methods", "qlora",
              "--json")
    assert out.returncode == 0, out.stderr
    qlora = [r for r in json.loads(out.stdout)["rows"] if r["method"] == "qlora"]
    assert sorted((r["gpus"], r["zero"]) for r in qlora) == [(4, 0), (4, 1), (4, 2), (4, 3)]
    est = run("estimate", "--model", "llama-3.2-1b-instruct", "--gpus", "2", "--zero", "2", "--method", "qlora",
              "--quant", "nf4", "--precision", "bf16")
    assert est.returncode == 0, est.stderr
    tp = run("estimate", "--model", "llama-3.2-1b-instruct", "--gpus", "2", "--tp", "2", "--method", "qlora",
             "--quant", "nf4", "--precision", "bf16")
    assert tp.returncode == 2 and "tp" in tp.stderr and "Traceback" not in tp.stderr


def test_ckpt_every_changes_the_estimate():
    base = ["estimate", "--model", "llama-3.1-8b", "--seq-len", "8192", "--grad-ckpt", "full", "--json"]
    full, every4 = (json.loads(run(*base, *extra).stdout)["peak_bytes"] for extra in ([], ["--ckpt-every", "4"]))
    assert every4 > full


def test_lora_modules_to_save_adds_the_trained_copies():
    base = ["estimate", "--model", "llama-3.1-8b", "--method", "lora", "--json"]
    plain, head = (json.loads(run(*base, *extra).stdout) for extra in ([], ["--lora-modules-to-save", "lm_head"]))
    assert head["trainable_params"] - plain["trainable_params"] == 128256 * 4096  # the lm_head copy
    assert head["peak_bytes"] > plain["peak_bytes"]


def test_plan_ckpt_reports_the_choice():
    out = run("plan-ckpt", "--model", "llama-3.1-8b", "--gpus", "8", "--zero", "3", "--batch-size", "2",
              "--seq-len", "4096", "--gpu-type", "a100-80gb", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    chosen = data["chosen"]
    assert chosen["fits"] and chosen["device_total_bytes"] <= data["gpu_memory_bytes"]
    fewer = [o for o in data["options"] if o["recomputed_layers"] < chosen["recomputed_layers"]]
    assert fewer and not any(o["fits"] for o in fewer)
    text = run("plan-ckpt", "--model", "llama-3.1-8b", "--gpus", "8", "--zero", "3", "--gpu-type", "a100-80gb",
               "--seq-len", "8192")
    assert text.returncode == 0 and "<- chosen" in text.stdout and "FLOPs" in text.stdout
    none = run("plan-ckpt", "--model", "llama-3.1-8b", "--gpu-type", "l4")
    assert none.returncode == 1 and "nothing fits" in none.stdout


def test_offload_reports_host_memory_separately():
    out = run("estimate", "--model", "llama-3.2-1b-instruct", "--gpus", "4", "--zero", "3",
              "--offload", "optimizer+params", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert sum(data["breakdown"].values()) == data["peak_bytes"]
    # only the model's buffers stay on the GPU (fully_shard moves them to the device): RoPE's inv_freq and
    # original_inv_freq, head_dim / 2 fp32 elements each (llama-3.2-1b: 2048 / 32 heads = 64)
    assert data["breakdown"]["parameters"] == 2 * (64 // 2) * 4 and data["breakdown"]["optimizer states"] == 0
    assert data["host_bytes"] == sum(data["host_breakdown"].values()) > 0
    assert data["host_node_bytes"] == 4 * data["host_bytes"]
    human = run("estimate", "--model", "llama-3.2-1b-instruct", "--gpus", "4", "--zero", "3",
                "--offload", "optimizer+params")
    assert human.returncode == 0 and "host memory" in human.stdout


@pytest.mark.parametrize("args, field", [
    (["--offload", "optimizer", "--gpus", "4", "--zero", "3"], "offload"),
    (["--loss", "fused-linear-ce", "--device", "cpu"], "loss"),
    (["--loss", "chunked"], "loss"),
])
def test_offload_and_loss_errors_name_the_field(args, field):
    out = run("estimate", "--model", "llama-3.2-1b-instruct", *args)
    assert out.returncode != 0 and field in out.stderr and "Traceback" not in out.stderr


def test_compare_shows_host_ram_beside_offloaded_rows():
    out = run("compare", "--model", "llama-3.2-1b-instruct", "--gpus", "4", "--methods", "offload-optimizer")
    assert out.returncode == 0, out.stderr
    header, *lines = [line for line in out.stdout.splitlines() if "GiB per GPU" not in line][:9]
    assert "host_node_gib" in header
    offloaded = next(line for line in lines if line.lstrip().startswith("offload optimizer"))
    plain = next(line for line in lines if line.lstrip().startswith("DDP"))
    host = header.split().index("host_node_gib") - len(header.split())  # counted from the right
    assert float(offloaded.split()[host]) > 1 and float(plain.split()[host]) == 0


def test_engine_torch_is_the_default_and_deepspeed_is_modelled_for_zero_0_to_3_on_1_or_more_gpus():
    base = ["estimate", "--model", "gpt2", "--json"]
    torch_engine = run(*base, "--engine", "torch")
    assert torch_engine.returncode == 0 and json.loads(torch_engine.stdout) == json.loads(run(*base).stdout)
    one = run(*base, "--engine", "deepspeed", "--zero", "2")  # one GPU: ZeRO over a world of one
    assert one.returncode == 0 and any(n.startswith("ZeRO-2 epilogue") for n in json.loads(one.stdout)["phases"])
    ds = run(*base, "--engine", "deepspeed", "--optimizer", "adamw8bit")
    assert ds.returncode == 2 and "Traceback" not in ds.stderr and "engine" in ds.stderr
    zero3 = run(*base, "--engine", "deepspeed", "--gpus", "2", "--zero", "3", "--ds-persistence-threshold", "7680")
    assert zero3.returncode == 0, zero3.stderr
    assert any(name.startswith("ZeRO-3 reduce") for name in json.loads(zero3.stdout)["phases"])
    zero2 = run(*base, "--engine", "deepspeed", "--gpus", "2", "--zero", "2", "--ds-reduce-bucket", "1000000")
    assert zero2.returncode == 0, zero2.stderr
    assert json.loads(zero2.stdout)["peak_bytes"] != json.loads(run(*base, "--gpus", "2", "--zero", "2").stdout)[
        "peak_bytes"]
    bad = run(*base, "--engine", "jax")
    assert bad.returncode == 2 and "engine" in bad.stderr and "jax" in bad.stderr


def test_the_plan_commands_help_says_torch_compile_is_not_modelled_and_no_option_takes_it(capsys):
    """docs/notes/2026-11-27-torch-compile.md: compile's saved set is derivable on the CPU profile only, so the
    option is kept out; the help says so, and `--compile` is an unknown argument (exit 2, one line naming it)."""
    from pathlib import Path

    from llmem.cli import build_parser, main

    parser = build_parser()
    for command in ("estimate", "compare", "plan-ckpt"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "torch.compile is not modelled" in " ".join(capsys.readouterr().out.split()), command
    assert "torch.compile is not modelled" in " ".join(parser.format_help().split())
    assert (Path(__file__).parent.parent / "docs" / "notes" / "2026-11-27-torch-compile.md").is_file()
    assert main(["estimate", "--model", "gpt2", "--compile"]) == 2
    err = capsys.readouterr().err
    assert "--compile" in err and err.count("\n") == 1
