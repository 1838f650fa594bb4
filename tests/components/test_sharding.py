"""FSDP2's shard of one tensor under `--fsdp-shard` (torch 2.13 `FSDPParam._init_sharded_param`): dim 0 padded to
ceil(rows / ranks) rows; Shard(1) only where the plan asks for it, dim 0 is short and dim 1 divides evenly."""

import pytest

from llmem.components.sharding import fsdp_shard_dim, fsdp_shard_numel
from llmem.errors import InputError
from llmem.plan import TrainingPlan

DIM1 = dict(zero=3, fsdp_shard="dim1-if-short")


@pytest.mark.parametrize("shape,gpus,plan,dim,numel", [
    ((8, 28672, 4096), 64, DIM1, 1, 8 * 28672 * 4096 // 64),  # Mixtral's stacked gate_up: 8 rows < 64 ranks
    ((8, 28672, 4096), 64, {"zero": 3}, 0, 28672 * 4096),  # the default pads 8 rows to 64: one row per rank
    ((8, 30, 4), 64, DIM1, 0, 30 * 4),  # dim 1 uneven: FSDP2 refuses Shard(1), so dim 0 stays
    ((8, 4096), 8, DIM1, 0, 4096),  # not short: 8 rows on 8 ranks
    ((4096,), 64, DIM1, 0, 64),  # 1-D tensors have no dim 1
    ((100, 64), 64, DIM1, 0, 2 * 64),  # ceil(100 / 64) = 2 rows
])
def test_shard_dim_and_size(shape, gpus, plan, dim, numel):
    p = TrainingPlan(gpus=gpus, **plan)
    assert fsdp_shard_dim(shape, p) == dim
    assert fsdp_shard_numel(shape, p) == numel


def test_a_bad_fsdp_shard_value_names_the_field():
    with pytest.raises(InputError) as err:
        TrainingPlan(gpus=8, zero=3, fsdp_shard="dim2")
    assert err.value.field == "fsdp-shard"


def test_the_gathered_decoder_layer_is_the_largest_layer_not_layer_0():
    """qwen3_moe with a dense layer 0 (`mlp_only_layers`): the expert layers gather more than layer 0; counted at
    layer 0's, ZeRO-3 read 1.0-1.4 % under the measured peak (suite rows d2-qwen3moe-mlponly-*-zero3)."""
    from llmem.components.sharding import shard_summary
    from llmem.spec import ModelSpec
    from tests.derive.configs import config

    spec = ModelSpec.from_config(config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0]))
    plan = TrainingPlan(gpus=2, zero=3)
    per_layer = [sum(p.numel for p in spec.layer_params(k)) for k in range(3)]
    assert per_layer[0] < per_layer[1] == per_layer[2]  # a dense MLP of 128 against 4 experts of 48 and a router
    assert shard_summary(spec, plan).gathered_layer == per_layer[1]  # 2 ranks divide every dim 0 evenly here


def test_each_decoder_layer_gathers_its_own_parameters():
    """FSDP2 all-gathers each decoder layer's own group (`FSDPParamGroup.unshard`): counted per layer, against the
    parameters of each layer of the model transformers builds (meta device), as the all-gather output holds them (2
    ranks divide every dim 0 here, so no padding); with LoRA the layer's adapters join its group."""
    import peft
    import torch
    import transformers

    from llmem.components import communication as comm
    from llmem.spec import ModelSpec
    from tests.derive.configs import config

    cfg = config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2)  # layers 1 and 3 with experts
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    built = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert built[0] == built[2] < built[1] == built[3]
    spec = ModelSpec.from_config(cfg)
    assert comm.layers_unsharded_bytes(spec, TrainingPlan(gpus=2, zero=3, precision="fp32")) == tuple(
        4 * n for n in built)
    mixed = TrainingPlan(gpus=2, zero=3, precision="bf16-mixed")  # gathered in the policy's param_dtype
    assert comm.layers_unsharded_bytes(spec, mixed) == tuple(2 * n for n in built)
    assert comm.layer_unsharded_bytes(spec, mixed) == 2 * built[1]  # no layer named: the largest
    lora = TrainingPlan(gpus=2, zero=3, precision="fp32", method="lora", lora_targets="all-linear", lora_rank=8)
    with torch.device("meta"):
        peft_model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    adapted = [sum(p.numel() for p in layer.parameters()) for layer in peft_model.base_model.model.model.layers]
    assert adapted[0] - built[0] != adapted[1] - built[1]  # a dense MLP's adapters and the experts' differ
    assert comm.layers_unsharded_bytes(spec, lora) == tuple(4 * n for n in adapted)
