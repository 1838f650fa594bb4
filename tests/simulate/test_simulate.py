"""The simulation against real CPU runs (small configurations) and against the closed-form estimate (full size)."""

import json

import pytest

from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.simulate import simulate
from llmem.spec import ModelSpec
from tests.measure.conftest import GPT2, LLAMA, MIXTRAL

SMALL = dict(device="cpu", batch_size=2, seq_len=64, precision="fp32", optimizer_impl="forloop")


@pytest.mark.parametrize("config,plan", [
    (LLAMA, {}),
    (LLAMA, {"precision": "bf16-mixed", "optimizer_impl": "foreach"}),
    (LLAMA, {"grad_ckpt": "full", "attn": "eager"}),
    (LLAMA, {"precision": "bf16", "optimizer_impl": "fused", "optimizer": "adamw"}),
    (GPT2, {}),
    (LLAMA, {"method": "lora"}),
    (LLAMA, {"method": "lora", "lora_targets": "all-linear", "precision": "bf16"}),
    (GPT2, {"method": "lora", "lora_targets": "all-linear", "precision": "bf16-mixed"}),
    (LLAMA, {"method": "lora", "lora_modules_to_save": "lm_head", "precision": "bf16-mixed", "grad_ckpt": "full"}),
    (LLAMA, {"optimizer": "adafactor"}),
    (LLAMA, {"optimizer": "adafactor", "precision": "bf16-mixed", "optimizer_impl": "foreach"}),
    (LLAMA, {"optimizer": "adamw8bit", "optimizer_impl": "default"}),
    (LLAMA, {"optimizer": "sgd", "optimizer_impl": "fused", "precision": "bf16", "grad_accum": 2}),
    (LLAMA, {"optimizer": "paged-adamw8bit", "optimizer_impl": "default", "precision": "bf16-mixed"}),
    (MIXTRAL, {}),
    (MIXTRAL, {"precision": "bf16-mixed", "grad_ckpt": "full"}),
    (MIXTRAL, {"precision": "bf16"}),
    (LLAMA, {"method": "qlora", "quant": "nf4", "precision": "bf16"}),
    (LLAMA, {"method": "qlora", "quant": "fp4", "double_quant": True, "precision": "bf16"}),
    (LLAMA, {"method": "qlora", "quant": "nf4", "precision": "fp16", "grad_ckpt": "full",
             "lora_targets": "all-linear"}),
    (LLAMA, {"method": "qlora", "quant": "int8", "precision": "bf16"}),
    (LLAMA, {"loss": "chunked-ce", "loss_chunks": 4, "precision": "bf16-mixed"}),
], ids=["llama-fp32", "llama-bf16mix-foreach", "llama-ckpt-eager", "llama-bf16-fused", "gpt2-fp32",
        "lora", "lora-all-linear-bf16", "gpt2-lora-bf16mix", "lora-save-lm_head-ckpt", "adafactor",
        "adafactor-foreach-bf16mix", "adamw8bit", "sgd-fused-bf16-accum", "paged-adamw8bit-bf16mix",
        "mixtral-fp32", "mixtral-ckpt-bf16mix",
        "mixtral-bf16", "qlora-nf4", "qlora-fp4-double-quant", "qlora-nf4-fp16-ckpt-all-linear", "qlora-int8",
        "chunked-ce-bf16mix"])
def test_single_rank_matches_real_cpu_run(config, plan):
    """Same runtime, real tensors vs fake: the peak agrees to within 0.1% (to the byte for most rows; a few
    bytes of 0-dim tensors made outside dispatch are the known difference, see docs/SIMULATION.md)."""
    p = TrainingPlan(**{**SMALL, **plan})
    real = measure_rank(dict(config), p)["peak_bytes"]
    sim = simulate(dict(config), p)
    assert abs(sim.peak_bytes - real) <= max(64, real // 1000), (sim.peak_bytes, real)
    assert sim.peak_iteration in (1, 2)


@pytest.mark.parametrize("plan", [{"gpus": 2, "zero": 3}, {"gpus": 2, "tp": 2}, {"gpus": 2},
                                  pytest.param({"gpus": 2, "zero": 3, "method": "qlora", "quant": "nf4",
                                                "precision": "bf16"}, marks=pytest.mark.slow)],
                         ids=["zero3", "tp", "ddp", "qlora-zero3"])
def test_multi_rank_matches_real_gloo_run(plan):
    """To 64 B; QLoRA to 0.1%: a fresh torchrun process also counts the host tensors PEFT and bitsandbytes make
    when they are first imported (inside the build: 516 B here), which the simulation imports beforehand."""
    from llmem.measure.cli import measure

    p = TrainingPlan(**{**SMALL, **plan})
    real = measure(dict(LLAMA), p)["peak_bytes"]
    sim = simulate(dict(LLAMA), p)
    slack = 64 if p.method.value == "full" else real // 1000
    assert abs(sim.peak_bytes - real) <= slack, (sim.peak_bytes, real)


@pytest.mark.parametrize("preset,plan", [
    ("smollm2-135m", {}),
    ("smollm2-135m", {"gpus": 8, "zero": 3}),
    ("qwen2.5-0.5b", {"gpus": 4, "tp": 2, "zero": 3}),
    ("llama-3.2-1b-instruct", {"gpus": 8, "zero": 1}),
    ("gemma-2-2b", {"attn": "eager"}),  # eager-only family: 2048² softcapped scores per layer
    # FSDP2 computes in bf16: Qwen3's q_norm/k_norm keep an fp32 copy of their input (−3.2% without it)
    ("qwen3-4b", {"gpus": 8, "zero": 3}),
    # falcon's multi-query math-path attention peaks in the last layer's softmax backward (−2.3% without it)
    ("falcon-7b", {"gpus": 8, "zero": 3}),
])
def test_full_size_agrees_with_closed_form(preset, plan):
    config = load_preset(preset)
    p = TrainingPlan(batch_size=1, seq_len=2048, **plan)
    sim = simulate(config, p)
    est = estimate(ModelSpec.from_config(config), p)
    assert abs(est.peak_bytes - sim.peak_bytes) <= 0.02 * sim.peak_bytes, (est.peak_bytes, sim.peak_bytes)
    assert sim.reserved_bytes >= sim.allocated_rounded_bytes >= sim.peak_bytes


# Untied embedding and lm_head that outweigh a small MLP (mistral-nemo-12b's shape at reduced size): under ZeRO-3 with
# full checkpointing the rank peaks at the root's reduce-scatter copy-in, where every unsharded root gradient
# (param_dtype) is alive beside the fp32 reduce_scatter_input (-6.1% without that moment).
HEAVY_HEAD = dict(model_type="mistral", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32768, max_position_embeddings=4096,
                  tie_word_embeddings=False)


@pytest.mark.parametrize("plan", [{}, {"fsdp_shard": "dim1-if-short"}])
def test_root_reduce_scatter_copy_in_agrees_with_simulate(plan):
    """The simulation equals real GPU runs to the byte; the closed form within 0.1% (a few KiB of small tensors)."""
    p = TrainingPlan(gpus=8, zero=3, precision="bf16-mixed", grad_ckpt="full", batch_size=1, seq_len=256, **plan)
    sim = simulate(dict(HEAVY_HEAD), p)
    est = estimate(ModelSpec.from_config(HEAVY_HEAD), p)
    assert abs(est.peak_bytes - sim.peak_bytes) <= 0.001 * sim.peak_bytes, (est.peak_phase, est.peak_bytes,
                                                                            sim.peak_bytes)


def test_result_shape_and_timeline():
    sim = simulate(dict(LLAMA), TrainingPlan(**SMALL))
    d = sim.to_dict(max_points=50)
    json.dumps(d)
    assert d["peak_bytes"] == sim.peak_bytes and len(d["timeline"]) <= 50
    assert max(p[1] for p in sim.timeline) == sim.peak_bytes
    assert max(p[1] for p in sim.timeline_points(50)) == sim.peak_bytes  # thinning keeps the peak
    assert {p[2] for p in sim.timeline} >= {"forward", "loss", "backward", "optimizer"}
    assert len(sim.top_tensors) == 20 and sim.top_tensors[0].nbytes >= sim.top_tensors[-1].nbytes
    assert sum(t.nbytes for t in sim.top_tensors) <= sim.peak_bytes
    assert any(t.module.startswith("model.layers.") for t in sim.top_tensors)
    assert sim.fragmentation_bytes == sim.reserved_bytes - sim.peak_bytes >= 0


def test_ddp_buckets_are_marked_closed_form():
    sim = simulate(dict(LLAMA), TrainingPlan(**SMALL, gpus=2))
    assert sim.closed_form and any(t.closed_form for t in sim.top_tensors)


def test_simulation_does_not_leave_fake_tensors_behind():
    """PEFT and bitsandbytes make tensors at import time; imported inside the fake mode they would stay fake for the
    rest of the process. A second simulation of the same plan gives the same figures, and a real run after it
    still agrees."""
    p = TrainingPlan(**{**SMALL, "method": "lora", "optimizer": "adamw8bit", "optimizer_impl": "default"})
    first, second = simulate(dict(LLAMA), p), simulate(dict(LLAMA), p)
    assert (first.peak_bytes, first.live_at_reset) == (second.peak_bytes, second.live_at_reset)
    real = measure_rank(dict(LLAMA), p)["peak_bytes"]
    assert abs(first.peak_bytes - real) <= 128, (first.peak_bytes, real)


def test_paged_states_stay_out_of_the_peak_on_cuda():
    """cuda profile: PagedAdamW8bit's states of tensors with >= 1e5 elements live in unified memory. The
    simulation's peak is the non-paged one minus exactly those states (uint8 state1 + state2, fp32 absmax per 256),
    computed here from the model's parameters; the estimate's `paged_state_bytes` is the same figure."""
    import torch

    from llmem.runtime import build_model

    config = {**LLAMA, "vocab_size": 2048}
    plan = TrainingPlan(**{**SMALL, "device": "cuda", "optimizer": "adamw8bit", "optimizer_impl": "default"})
    paged_plan = plan.with_(optimizer="paged-adamw8bit")
    with torch.device("meta"):
        sizes = [p.numel() for p in build_model(dict(config), plan, "meta").parameters()]
    expected = sum(2 * n for n in sizes if n >= 100_000)  # the absmax stay on the device (torch.zeros, not paged)
    plain, paged = simulate(dict(config), plan), simulate(dict(config), paged_plan)
    assert paged.paged_state_bytes == expected > 0
    assert plain.peak_bytes - paged.peak_bytes == expected
    assert estimate(ModelSpec.from_config(config), paged_plan).to_dict()["paged_state_bytes"] == expected


def test_cli_json_and_timeline(tmp_path, capsys):
    from llmem.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    tl = tmp_path / "tl.csv"
    rc = main(["simulate", "--model", str(cfg), "--batch-size", "2", "--seq-len", "32", "--precision", "fp32",
               "--device", "cpu", "--json", "--timeline", str(tl)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_bytes"] > 0 and out["reserved_bytes"] >= out["peak_bytes"]
    assert tl.read_text().splitlines()[0] == "op_index,live_bytes,phase"


def test_grad_accum_matches_real_cpu_run():
    p = TrainingPlan(**SMALL, grad_accum=2)
    assert simulate(dict(LLAMA), p).peak_bytes == measure_rank(dict(LLAMA), p)["peak_bytes"]


@pytest.mark.parametrize("plan, field", [
    ({"offload": "optimizer", "device": "cuda"}, "offload"),
    ({"loss": "fused-linear-ce", "device": "cuda"}, "loss"),
    ({"gpus": 2, "ddp_bucket_view": True}, "ddp-bucket-view"),
])
def test_steps_fake_tensors_cannot_run_are_refused_naming_the_option(plan, field):
    from llmem.errors import InputError

    with pytest.raises(InputError) as err:
        simulate(dict(LLAMA), TrainingPlan(**{**SMALL, **plan}))
    assert err.value.field == field


@pytest.mark.parametrize("routing", ["random", "all-to-one-pair"])
def test_moe_memory_does_not_depend_on_the_routing(routing):
    """transformers 5's grouped experts sort the tokens × top_k rows by expert: every tensor has the same size
    whatever the routing. The real CPU run with its random router, and with the router zeroed (equal logits: every
    token to the same two experts, CPU's `topk` of equal scores; the most unbalanced routing), peaks at the simulated
    bytes."""
    import torch

    def zero_router(session, _mark):
        with torch.no_grad():
            for name, p in session.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.zero_()

    p = TrainingPlan(**SMALL)
    hook = zero_router if routing == "all-to-one-pair" else None
    measure_rank(dict(MIXTRAL), p)  # a first run in the process also counts import-time tensors
    real = measure_rank(dict(MIXTRAL), p, mark_hook=hook)["peak_bytes"]
    assert simulate(dict(MIXTRAL), p).peak_bytes == real


@pytest.mark.parametrize("plan", [
    {"optimizer": "sgd", "optimizer_impl": "fused"},
    {"method": "qlora", "quant": "nf4", "precision": "bf16", "optimizer": "adamw8bit", "optimizer_impl": "default"},
    {"optimizer": "adafactor", "device": "cuda"},
], ids=["sgd-fused", "qlora-adamw8bit", "adafactor-cuda"])
def test_no_op_falls_back_to_its_real_kernel(monkeypatch, plan):
    """An op without a fake kernel makes FakeTensorMode run the real CPU kernel on zero-filled real copies of its
    arguments (`run_fallback_kernel`): real host memory the size of the model at full size (`_fused_sgd_` took
    20 GB for a 7B plan). No op of these plans may take that path."""
    from torch._subclasses import fake_tensor

    def refuse(*args, **kwargs):
        raise AssertionError(f"real kernel fallback for {args[1]}")

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", refuse)
    simulate(dict(MIXTRAL if "method" not in plan else LLAMA), TrainingPlan(**{**SMALL, **plan}))


def test_a_large_real_kernel_fallback_stops_with_one_line():
    """Without a fake kernel (no stand-in here: no tracker), `_fused_sgd_` on 96 MiB of fake tensors would run the
    real kernel on real zero-filled copies; the simulation's guard stops it, naming the op."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.simulate.patches import bounded_fallback

    with FakeTensorMode(), bounded_fallback(limit=64 << 20):
        p, g, m = (torch.empty(8 << 20) for _ in range(3))
        with pytest.raises(RuntimeError, match="_fused_sgd_.*has no fake kernel"):
            torch._fused_sgd_([p], [g], [m], weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=False)


def test_the_packed_sequence_patch_computes_transformers_indices_under_cp():
    """`--cp`: a rank's head-tail shard of position ids jumps (rank 0 of 2 holds chunks 0 and 3); the simulation's
    patch must return what transformers' own check returns for it (and None where the ids are one sequence)."""
    import torch
    from transformers import masking_utils

    from llmem.simulate import patches

    orig = masking_utils.find_packed_sequence_indices
    jumped = torch.cat([torch.arange(0, 8), torch.arange(24, 32)]).expand(2, -1)
    with patches.no_packed_sequence_check(packed=True):
        assert torch.equal(masking_utils.find_packed_sequence_indices(jumped), orig(jumped))
    with patches.no_packed_sequence_check():
        assert masking_utils.find_packed_sequence_indices(jumped) is None
    assert orig(torch.arange(16).expand(2, -1)) is None
