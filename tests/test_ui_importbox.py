"""The app's import box (`llmem.ui.importbox`): the files' options laid over the current inputs and repaired as a
link's, with the report as notes."""

from pathlib import Path

import pytest

from llmem import share
from llmem.errors import InputError
from llmem.ui.importbox import imported_inputs

CONFIGS = Path(__file__).parent / "data" / "configs"


def _files(*names: str) -> list[tuple[bytes, str]]:
    return [((CONFIGS / n).read_bytes(), n) for n in names]


def test_a_torchtune_lora_recipe_sets_the_model_and_its_lora_fields():
    inputs, notes = imported_inputs(_files("torchtune_8B_lora.yaml"), False, share.AppInputs(model="gpt2"))
    assert (inputs.model, inputs.method, inputs.lora_rank, inputs.lora_targets) == ("llama-3.1-8b", "lora", 8,
                                                                                      "q_proj,v_proj")
    assert inputs.gpu_type == share.AppInputs().gpu_type  # what no file says keeps the page's value
    assert any(n.startswith("used") for n in notes)


def test_deepspeed_zero3_selects_its_engine_its_offload_is_repaired_like_a_link_and_maps_with_pytorch():
    current = share.AppInputs(gpus=8, model="gpt2")
    text = b'{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}}'
    own, _ = imported_inputs([(text, "ds.json")], False, current)
    assert (str(own.engine), own.zero, own.ds_persistence_threshold) == ("deepspeed", 3, 10 * 768)
    offloaded, notes = imported_inputs(_files("ds_z3_offload.json"), False, current)
    assert str(offloaded.engine) == "torch" and any(n.startswith("engine: DeepSpeed's offload") for n in notes)
    mapped, notes = imported_inputs(_files("ds_z3_offload.json"), True, current)
    assert (mapped.zero, mapped.gpus, str(mapped.offload)) == (3, 8, "optimizer+params")
    assert any("ignored" in n for n in notes)


def test_an_unreadable_file_is_one_line_naming_it():
    with pytest.raises(InputError) as err:
        imported_inputs([(b"\x80\x04pickle", "training_args.bin")], False, share.AppInputs())
    assert "training_args.bin" in str(err.value) and "\n" not in str(err.value)


def test_deepspeed_zero2_selects_its_engine_and_an_auto_bucket_is_the_presets_hidden_size_squared():
    text = b'{"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": true}}'
    inputs, _ = imported_inputs([(text, "ds.json")], False, share.AppInputs(model="gpt2", gpus=2))
    assert (str(inputs.engine), inputs.zero, inputs.ds_overlap_comm, inputs.ds_reduce_bucket) == (
        "deepspeed", 2, True, 768 ** 2)
