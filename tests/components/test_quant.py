"""QLoRA (`--method qlora --quant nf4|fp4|int8`): the quantized base's storage against the tensors bitsandbytes really
creates, plan validation, and the single-rank estimate against a real CPU run (allocator trace) within 2 %."""

from __future__ import annotations

import pytest

from llmem.components import quant
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import _LLAMA
from tests.components.test_activations import CONFIGS as _CONFIGS

CONFIGS = {**_CONFIGS, "qwen2": dict(model_type="qwen2", **_LLAMA),  # q/k/v with biases: kept beside the codes
           "deep": dict(_CONFIGS["llama"], num_hidden_layers=5)}  # --ckpt-every K: both kinds of layer, repeated


def test_plan_validation_names_the_flag():
    with pytest.raises(InputError, match="double-quant"):  # nested quantization of 4-bit block scales only
        TrainingPlan(method="qlora", quant="int8", precision="bf16", double_quant=True)
    with pytest.raises(InputError, match="double-quant"):
        TrainingPlan(method="lora", double_quant=True)
    with pytest.raises(InputError, match="double-quant"):
        TrainingPlan(method="qlora", quant="nf4", precision="bf16", double_quant="maybe")
    with pytest.raises(InputError, match="quant"):
        TrainingPlan(method="qlora")
    TrainingPlan(method="qlora", quant="int8", precision="bf16", grad_ckpt="full", ckpt_every=2)  # modelled
    TrainingPlan(method="qlora", quant="int8", precision="bf16", gpus=2)  # DDP over the 8-bit base: modelled
    with pytest.raises(InputError, match="CB/SCB"):  # FSDP2 drops the 8-bit weight's attributes
        TrainingPlan(method="qlora", quant="int8", precision="bf16", gpus=2, zero=3)
    with pytest.raises(InputError, match="quant"):
        TrainingPlan(method="lora", quant="nf4")
    with pytest.raises(InputError, match="quant"):
        TrainingPlan(method="qlora", quant="q3")
    TrainingPlan(method="qlora", quant="nf4", precision="bf16-mixed", gpus=2, zero=1)  # autocast: modelled
    TrainingPlan(method="qlora", quant="nf4", precision="bf16-mixed", gpus=2, zero=3)  # FSDP2's policy: modelled
    with pytest.raises(InputError, match="precision"):  # 8-bit under autocast
        TrainingPlan(method="qlora", precision="bf16-mixed", quant="int8")
    TrainingPlan(method="qlora", quant="nf4", precision="bf16", gpus=2, zero=3)  # FSDP2: modelled
    with pytest.raises(InputError, match="tp"):
        TrainingPlan(method="qlora", quant="nf4", precision="bf16", gpus=2, tp=2)


def test_double_quantization_saves_three_bytes_per_block_at_size():
    """At 4096 x 4096 the fp32 absmax (4 B per block of 64) becomes 1 B per block plus one fp32 per 256 blocks and
    the nested state's constants: about 0.37 bits per weight less."""
    n = 4096 * 4096
    saved = quant.storage_bytes(n) - quant.storage_bytes(n, double_quant=True)
    assert 0.36 < saved * 8 / n < 0.38


def test_storage_formula():
    # 4096 x 4096: 8 MiB of packed codes, 262144 fp32 absmax, one 16-entry fp32 table
    assert quant.storage_bytes(4096 * 4096) == 4096 * 4096 // 2 + 4 * 4096 * 4096 // 64 + 64
    assert quant.storage_bytes(65) == 33 + 8 + 64  # odd count and a partial block round up


@pytest.mark.parametrize("family,q,precision,dq", [("llama", "nf4", "bf16", False), ("qwen3", "fp4", "fp32", False),
                                                    ("llama", "nf4", "bf16", True), ("qwen3", "fp4", "fp32", True),
                                                    ("llama", "int8", "bf16", False), ("qwen3", "int8", "fp32", False),
                                                    ("qwen2", "nf4", "bf16", False), ("qwen2", "int8", "bf16", False)])
def test_parameter_bytes_equal_the_quantized_model(family, q, precision, dq):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model

    plan = TrainingPlan(method="qlora", quant=q, precision=precision, device="cpu", double_quant=dq)
    model = apply_method(build_model(CONFIGS[family], plan), plan)
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is not None and isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            add(qs.absmax)
            add(qs.code)
            add(qs.offset)  # double quantization: the mean of the absmax, and the nested state's scales and code
            if qs.state2 is not None:
                add(qs.state2.absmax)
                add(qs.state2.code)
            assert (qs.state2 is not None) is dq
        add(getattr(p, "SCB", None))  # Int8Params: int8 CB is the parameter's data, fp32 SCB beside it
    for b in model.buffers():  # RoPE's inv_freq and original_inv_freq (`components.buffers`)
        add(b)
    if dq:  # the process's own map, made by the first double quantization and kept (bitsandbytes' name2qmap)
        from bitsandbytes import functional

        add(functional.name2qmap["dynamic"])
    from llmem.components.parameters import parameter_bytes

    assert parameter_bytes(ModelSpec.from_config(CONFIGS[family]), plan) == total


def _error(family: str, **plan) -> float:
    pytest.importorskip("bitsandbytes")
    from llmem.measure.timeline import timeline

    plan = {"precision": "fp32", "method": "qlora", "quant": "nf4", "lora_dropout": 0.0, "batch_size": 4,
            "seq_len": 64, **plan}
    p = TrainingPlan(device="cpu", optimizer_impl="forloop", **plan)
    measured = timeline(CONFIGS[family], p).peak_bytes
    return (estimate(ModelSpec.from_config(CONFIGS[family]), p).peak_bytes - measured) / measured


@pytest.mark.parametrize("family,plan", [
    ("llama", {}),
    ("llama", dict(quant="fp4", lora_dropout=0.1)),
    ("llama", dict(precision="bf16")),
    ("llama", dict(grad_ckpt="full")),
    ("qwen3", dict(grad_ckpt="full", quant="fp4")),
    ("llama", dict(batch_size=1, seq_len=16)),  # few tokens: the dequantized weight sets the peak
    ("qwen3", dict(batch_size=1, seq_len=16)),
    ("llama", dict(batch_size=2, seq_len=16, grad_ckpt="full", lora_dropout=0.1)),
    ("llama", dict(double_quant=True)),  # nested block scales (--double-quant)
    ("qwen3", dict(double_quant=True, precision="bf16", grad_ckpt="full")),
    ("qwen2", dict(precision="bf16")),  # biased q/k/v: each bias stays a plain tensor of the 4-bit Linear
    ("qwen2", dict(grad_ckpt="full", quant="fp4")),
])
def test_qlora_estimate_matches_cpu_run(family, plan):
    # 2 %: the project's single-rank bar; measured errors are 0.01-1.1 % (docs/notes/2026-11-26-methods-lora-qlora.md)
    assert abs(_error(family, **plan)) < 0.02


# --- 8-bit base (`--quant int8`) -----------------------------------------------------------------------------------

def test_int8_storage_formula():
    # 4096 x 11008 (out 4096): 1 byte per weight, one fp32 absmax per output row
    assert quant.int8_storage_bytes(4096 * 11008, 4096) == 4096 * 11008 + 4 * 4096


def test_int8_quantize_base_matches_the_loader():
    """The runtime's 8-bit base is what transformers' loader makes for load_in_8bit: Linear8bitLt modules with
    has_fp16_weights False and threshold 6.0, int8 weights, the output layer untouched."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model

    plan = TrainingPlan(method="qlora", quant="int8", precision="bf16", device="cpu")
    model = apply_method(build_model(CONFIGS["llama"], plan), plan)
    eight = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(eight) == 7 * CONFIGS["llama"]["num_hidden_layers"]
    for m in eight:
        assert m.weight.dtype == torch.int8 and m.weight.SCB.dtype == torch.float32
        assert m.state.threshold == 6.0 and not m.state.has_fp16_weights
    assert type(model.get_output_embeddings()) is torch.nn.Linear


def _int8_run(family: str, **plan):
    pytest.importorskip("bitsandbytes")
    from llmem.measure.timeline import phases, timeline

    plan = {"precision": "fp32", "method": "qlora", "quant": "int8", "lora_dropout": 0.0, "batch_size": 4,
            "seq_len": 64, **plan}
    p = TrainingPlan(device="cpu", optimizer_impl="forloop", **plan)
    trace = timeline(CONFIGS[family], p)
    return estimate(ModelSpec.from_config(CONFIGS[family]), p), trace, phases(trace)


@pytest.mark.parametrize("family,plan", [
    ("llama", {}),
    ("llama", dict(lora_dropout=0.1)),  # the inputs LoRA does not keep are held by the 8-bit nodes
    ("llama", dict(precision="bf16")),
    ("llama", dict(grad_ckpt="full")),  # checkpointing does not drop them: the backward of layer 0 peaks
    ("qwen3", dict(grad_ckpt="full", batch_size=2)),
    ("llama", dict(grad_ckpt="full", lora_dropout=0.1)),  # the recomputed q/k/v input stays alive too
    ("llama", dict(batch_size=1, seq_len=16)),  # few tokens: the dequantized weight sets the peak
    ("qwen3", dict(lora_targets="q_proj,v_proj", lora_dropout=0.1)),
    ("qwen2", {}),  # biased q/k/v under the 8-bit base
    # --ckpt-every K: every layer's 8-bit nodes hold their inputs, each beyond its own saved tensors (-6 % before)
    ("deep", dict(grad_ckpt="full", ckpt_every=2, precision="bf16", lora_dropout=0.05)),
    pytest.param("deep", dict(grad_ckpt="full", ckpt_every=3), marks=pytest.mark.heavy),
])
def test_int8_estimate_matches_cpu_run(family, plan):
    # 2 %: the project's single-rank bar; measured errors are 0.01-1.1 % (docs/notes/2026-11-26-methods-lora-qlora.md)
    est, trace, _ = _int8_run(family, **plan)
    assert abs(est.peak_bytes - trace.peak_bytes) / trace.peak_bytes < 0.02


def test_dequantized_moments_of_micro_step_2_count_each_gradient_once():
    """Seed 12's s12-1913 (mistral int8 QLoRA, lm_head trained as a copy, checkpointed, --grad-accum 2: +1.24 %): in
    micro-step 2 a layer-backward moment with an 8-bit weight dequantized holds the `.grad`s its base moment holds
    (the head copy's, the later layers'); they were counted as new beside every gradient, i.e. twice. Bound 1 %, the
    project's bar (what is left here: under 0.05 %)."""
    pytest.importorskip("bitsandbytes")
    from llmem.measure.run import measure_rank
    from llmem.sweep.models import SMALL

    plan = TrainingPlan(device="cpu", method="qlora", quant="int8", precision="fp32", optimizer="sgd", batch_size=2,
                        seq_len=128, grad_ckpt="full", lora_targets="all-linear", lora_dropout=0.1,
                        lora_modules_to_save="lm_head", grad_accum=2)
    est = estimate(ModelSpec.from_config(SMALL["mistral"]), plan).peak_bytes
    measured = measure_rank(SMALL["mistral"], plan)["peak_bytes"]
    print(f"estimate {est:,} measured {measured:,} ({(est - measured) / measured:+.3%})")
    assert abs(est - measured) / measured < 0.01


def test_int8_inputs_held_until_the_outputs_are_dropped():
    """After the backward, the 8-bit nodes still hold their inputs: the measured end of backward and the optimizer
    step match the estimate's phases with those inputs (without them the estimate would be ~28 % low there)."""
    est, _, measured = _int8_run("llama")
    steady = measured[len(measured) // 2 + 1:]  # iteration 2
    optimizer = next(p for p in steady if p.name == "optimizer")
    last_backward = next(p for p in steady if p.name == "backward layer 0")
    phase = {p.name: p.total for p in est.phases}
    held = quant.held_input_bytes(ModelSpec.from_config(CONFIGS["llama"]), est.plan)[0]
    assert held > 0.1 * optimizer.peak
    assert abs(phase["optimizer step"] - optimizer.peak) / optimizer.peak < 0.01
    assert abs(phase["backward end"] - last_backward.end) / last_backward.end < 0.01


def test_int8_cuda_profile_differs_only_in_the_forward_matmul():
    """cuda: `MatMul8bitLt` quantizes the input and writes an int32 product instead of dequantizing the weight;
    what the nodes keep and the backward are the same as on the cpu profile."""
    spec = ModelSpec.from_config(CONFIGS["llama"])
    plans = {d: TrainingPlan(method="qlora", quant="int8", precision="bf16", device=d, batch_size=4, seq_len=512,
                             lora_dropout=0.0)  # (dropout keeps a bool mask on cuda, noise on cpu)
             for d in ("cpu", "cuda")}
    tokens, h, i = 4 * 512, spec.hidden_size, spec.intermediate_size
    # gate/up (in h, out i): product moment CA + SCA + int32 + fp16 + bf16 outputs; down_proj's (in i, out h) is smaller
    assert quant.int8_forward_cuda_bytes(spec, plans["cuda"]) == max(
        tokens * i * (2 + 1 + 2 + 1) + tokens * 4, tokens * h + tokens * 4 + tokens * i * (4 + 2 + 2))
    fp16 = plans["cuda"].with_(precision="fp16")  # no fp16 copy of the input, no cast of the output
    assert quant.int8_forward_cuda_bytes(spec, fp16) < quant.int8_forward_cuda_bytes(spec, plans["cuda"])
    assert quant.held_input_bytes(spec, plans["cpu"]) == quant.held_input_bytes(spec, plans["cuda"])
    from llmem.components import Category

    cpu, cuda = ({p.name: p for p in estimate(spec, plan).phases} for plan in plans.values())
    for name in ("backward (first layer)", "backward end", "optimizer step"):
        assert cpu[name].breakdown[Category.ACTIVATIONS] == cuda[name].breakdown[Category.ACTIVATIONS] > 0
    assert "forward (last layer), 8-bit matmul (int8 input, int32 product)" in cuda
    assert "forward (last layer), 8-bit weight dequantized" in cpu


@pytest.mark.parametrize("plan", [
    dict(attn="eager"),  # o_proj's input is a contiguous copy no attention op saves: each 8-bit o_proj holds it
    dict(attn="eager", lora_modules_to_save="embed_tokens"),  # layer 0's input needs grad: its groups hold theirs
    dict(attn="sdpa", lora_modules_to_save="embed_tokens"),
    dict(attn="eager", lora_targets="o_proj", lora_modules_to_save="embed_tokens"),
])
def test_int8_held_inputs_follow_requires_grad(plan):
    """`MatMul8bitLt` keeps its input only when it needs a gradient; the 8-bit nodes of layer 0 whose input needs
    none keep nothing. Adapted MLP (or o_proj) only, pure fp16, eager or sdpa, with and without a trainable
    embedding copy: within 0.1 % of a real CPU run (the missing or extra held inputs were 0.4-1.3 % here)."""
    from llmem.measure.run import measure_rank

    config = CONFIGS["llama"]
    p = TrainingPlan(method="qlora", quant="int8", precision="fp16", device="cpu", optimizer="sgd",
                     optimizer_impl="foreach", batch_size=2, seq_len=64, lora_dropout=0.05,
                     **{"lora_targets": "gate_proj,up_proj,down_proj", **plan})
    measured = measure_rank(dict(config), p)["peak_bytes"]
    est = estimate(ModelSpec.from_config(config), p)
    assert abs(est.peak_bytes - measured) <= 0.001 * measured, (est.peak_phase, est.peak_bytes, measured)
