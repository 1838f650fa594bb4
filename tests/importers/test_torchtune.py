"""torchtune recipe YAML: component names are read as text, never imported."""

import sys

from llmem.importers import import_bytes

from .conftest import ignored, load, settings


def test_lora_recipe():
    r = load("torchtune_8B_lora.yaml")
    assert settings(r) == {
        "model": "llama-3.1-8b", "method": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "lora_targets": "q_proj,v_proj", "batch_size": 2, "grad_accum": 32, "precision": "bf16", "grad_ckpt": "none",
        "optimizer": "adamw", "optimizer_impl": "fused", "loss": "chunked-ce"}


def test_the_chunked_loss_is_read_eager_only():
    text = (b"loss:\n  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss\n  num_output_chunks: 4\n")
    assert settings(import_bytes(text, "recipe.yaml")) == {"loss": "chunked-ce", "loss_chunks": 4}
    r = import_bytes(text + b"compile: true\n", "recipe.yaml")
    assert "loss" not in settings(r) and "not modelled" in ignored(r, "loss._component_").why


def test_qlora_distributed_and_names_are_never_imported():
    text = (b"model:\n  _component_: evilpkg.models.qlora_llama3_2_1b\n  lora_attn_modules: [q_proj, output_proj]\n"
            b"  apply_lora_to_mlp: true\nfsdp_reshard_after_forward: true\ntokenizer:\n  max_seq_len: 1024\n"
            b"dataset:\n  packed: true\noptimizer:\n  _component_: bitsandbytes.optim.PagedAdamW8bit\n")
    r = import_bytes(text, "recipe.yaml")
    assert settings(r) == {"model": "llama-3.2-1b", "method": "qlora", "quant": "nf4",
                           "lora_targets": "q_proj,o_proj,gate_proj,up_proj,down_proj", "zero": 3, "seq_len": 1024,
                           "optimizer": "paged-adamw8bit"}
    assert "evilpkg" not in sys.modules


def test_what_is_not_modelled_says_which_way_the_estimate_errs():
    text = (b"model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 4\noptimizer_in_bwd: true\n"
            b"enable_activation_offloading: true\ncompile: true\ndtype: bf16\n")
    r = import_bytes(text, "full.yaml")
    assert settings(r) == {"model": "llama-3.2-1b", "batch_size": 4, "precision": "bf16"}
    assert ignored(r, "optimizer_in_bwd").why.endswith("an upper bound")
    assert ignored(r, "enable_activation_offloading").why.endswith("an upper bound")
    assert "torch.compile" in ignored(r, "compile").why


def test_lora_on_the_output_layer_is_the_lm_head_target():
    text = (b"model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n"
            b"  lora_attn_modules: [q_proj, v_proj]\n  apply_lora_to_output: true\n")
    assert settings(import_bytes(text, "recipe.yaml"))["lora_targets"] == "q_proj,v_proj,lm_head"
