"""axolotl YAML."""

from llmem.importers import import_bytes

from .conftest import ignored, load, settings, used


def test_qlora_example():
    r = load("axolotl_qlora.yml")
    assert settings(r) == {
        "method": "qlora", "quant": "nf4", "double_quant": True, "lora_rank": 32, "lora_alpha": 16,
        "lora_dropout": 0.05, "lora_targets": "all-linear", "batch_size": 2, "grad_accum": 4, "seq_len": 4096,
        "optimizer": "paged-adamw8bit", "optimizer_impl": "default", "precision": "bf16", "grad_ckpt": "full",
        "attn": "sdpa"}
    assert "does not download" in ignored(r, "base_model").why


def test_full_fine_tune_with_liger_and_fsdp1():
    text = (b"base_model: meta-llama/Llama-3.1-8B\nmicro_batch_size: 1\nsequence_len: 8192\nbf16: auto\n"
            b"liger_fused_linear_cross_entropy: true\nfsdp: [full_shard, auto_wrap]\nfsdp_config:\n"
            b"  fsdp_offload_params: true\n  fsdp_sharding_strategy: FULL_SHARD\n")
    r = import_bytes(text, "fft.yaml")
    assert settings(r) == {"model": "llama-3.1-8b", "batch_size": 1, "seq_len": 8192, "loss": "fused-linear-ce",
                           "precision": "bf16", "zero": 3, "engine": "fsdp1"}
    assert "'auto'" in used(r, "bf16")[0].why
    assert "FSDP1" in used(r, "fsdp_config.fsdp_sharding_strategy")[0].why
    assert "FSDP1" in ignored(r, "fsdp_config.fsdp_offload_params").why
    r = import_bytes(text + b"fsdp_version: 2\n", "fft.yaml")
    assert settings(r)["zero"] == 3 and settings(r)["offload"] == "optimizer+params"


def test_qlora_fsdp1_example():
    r = load("axolotl_qlora_fsdp.yaml")
    assert settings(r) == {
        "method": "qlora", "quant": "nf4", "double_quant": True, "lora_rank": 8, "lora_alpha": 16,
        "lora_dropout": 0.05, "lora_targets": "all-linear", "batch_size": 1, "grad_accum": 4, "seq_len": 512,
        "optimizer": "adamw", "optimizer_impl": "default", "precision": "bf16", "grad_ckpt": "full", "attn": "sdpa",
        "zero": 3, "engine": "fsdp1"}
    assert "FSDP1" in used(r, "fsdp_config.fsdp_sharding_strategy")[0].why
    assert "FSDP1" in ignored(r, "fsdp_config.fsdp_offload_params").why
    r = load("axolotl_qlora_fsdp.yaml", engine_torch=True)
    assert settings(r)["zero"] == 3 and settings(r)["offload"] == "optimizer+params"


def test_fsdp2_without_an_fsdp_list_and_legacy_strings_under_fsdp1():
    text = (b"base_model: gpt2\nmicro_batch_size: 1\nbf16: true\nfsdp_version: 2\nfsdp_config:\n"
            b"  offload_params: false\n  reshard_after_forward: false\n  auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    assert settings(import_bytes(text, "fsdp2.yaml"))["zero"] == 2
    text = b"base_model: gpt2\nmicro_batch_size: 1\nfsdp: [shard_grad_op, auto_wrap, offload]\n"
    fsdp1 = settings(import_bytes(text, "fsdp1.yaml"))
    assert (fsdp1["zero"], fsdp1["engine"]) == (2, "fsdp1") and "offload" not in fsdp1
    r = import_bytes(text, "fsdp1.yaml", engine_torch=True)
    assert settings(r)["zero"] == 2 and settings(r)["offload"] == "optimizer+params"
