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
