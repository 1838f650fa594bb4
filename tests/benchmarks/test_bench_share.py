"""Speed of a share link's decode and encode, and of the app's rerun after an input change (pytest-benchmark).
Run with `pytest tests/benchmarks --benchmark-enable`; in the normal suite each runs once as a smoke test."""

from llmem.share import decode, encode

LINK = {"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "8", "tp": "1", "zero": "3", "batch-size": "2",
        "seq-len": "4096", "precision": "bf16-mixed", "optimizer": "adamw", "optimizer-impl": "default",
        "grad-ckpt": "full", "attn": "sdpa", "quant": "none", "offload": "none", "loss": "standard",
        "method": "lora", "lora-rank": "64", "lora-targets": "q_proj,v_proj", "grad-accum": "4"}
TAMPERED = {"gpus": "6", "tp": "4", "zero": "1", "optimizer": "adafactor", "optimizer-impl": "fused",
            "method": "qlora", "quant": "int8", "ckpt-every": "3", "colour": "red"}


def test_decode_a_link(benchmark):
    inputs, warnings = benchmark(decode, LINK)
    assert inputs.gpus == 8 and not warnings


def test_decode_a_tampered_link(benchmark):
    inputs, warnings = benchmark(decode, TAMPERED)
    assert len(warnings) >= 3
    inputs.to_plan()


def test_encode_a_link(benchmark):
    inputs, _ = decode(LINK)
    assert benchmark(encode, inputs) == {k: v for k, v in LINK.items()}


def test_app_rerun_after_an_input_change(benchmark):
    from streamlit.testing.v1 import AppTest

    from tests.app.conftest import APP

    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"model": "qwen2.5-7b", "gpus": "8"})
    at.run()
    sizes = iter(range(10**6))

    def rerun():
        at.number_input(key="w_batch").set_value(2 + next(sizes) % 2)
        at.run()

    benchmark.pedantic(rerun, rounds=6, warmup_rounds=2)
    assert not at.exception
