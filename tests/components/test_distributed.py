"""The multi-rank terms, checked against sizes worked out by hand from torch 2.13's sources."""

from llmem.components import communication as comm
from llmem.components.optimizer import optimizer_state_bytes, zero1_partitions
from llmem.components.sharding import local_numel, unsharded_numel
from llmem.estimate import compute_plan, estimate
from llmem.plan import Precision, TrainingPlan
from llmem.spec import ModelSpec

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
          "tie_word_embeddings": False}
SPEC = ModelSpec.from_config(CONFIG)
# one decoder layer: q 128x128, k 64x128, v 64x128, o 128x128, gate/up 352x128, down 128x352, two norms of 128
LAYER = 2 * 16384 + 2 * 8192 + 3 * 45056 + 2 * 128
ROOT = 2 * 128000 + 128


def plan(**kw) -> TrainingPlan:
    return TrainingPlan(**{"batch_size": 2, "seq_len": 64, "precision": "fp32", "optimizer_impl": "forloop",
                           "device": "cpu", **kw})


def test_ddp_buckets_are_one_gradient_copy_and_rebuild_doubles_them_only_while_grads_view_them():
    p = plan(gpus=2)
    assert comm.standing_buffer_bytes(SPEC, p) == SPEC.total_params * 4
    # the rebuild clears the old buckets first unless micro-step 1's .grads view them (bucket view, K > 1)
    for kw in ({}, {"grad_accum": 2}, {"ddp_bucket_view": True}):
        assert comm.ddp_rebuild_bytes(SPEC, plan(gpus=2, **kw)) == 0
        assert not any(ph.name.startswith("DDP bucket rebuild") for ph in estimate(SPEC, plan(gpus=2, **kw)).phases)
    viewed = plan(gpus=2, grad_accum=2, ddp_bucket_view=True)
    assert comm.ddp_rebuild_bytes(SPEC, viewed) == SPEC.total_params * 4
    rebuild = next(ph for ph in estimate(SPEC, viewed).phases if ph.name.startswith("DDP bucket rebuild"))
    rope_buffers = 2 * (SPEC.head_dim // 2) * 4  # LlamaRotaryEmbedding's inv_freq and original_inv_freq, fp32
    # parameters (and the model's buffers), old and new buckets; no optimizer state yet
    assert rebuild.total == SPEC.total_params * 4 * 3 + rope_buffers


def test_zero1_greedy_partition_largest_first_to_least_loaded():
    parts = zero1_partitions(SPEC.params, 2)
    assert sum(map(sum, parts)) == SPEC.total_params
    assert parts[0][0] == parts[1][0] == 128000  # embed_tokens, then lm_head to the other rank
    adam = optimizer_state_bytes(SPEC, plan(gpus=2, zero=1))
    assert adam == 2 * max(map(sum, parts)) * 4 + 4 * max(len(x) for x in parts if sum(x) == max(map(sum, parts)))


def test_fsdp_pads_each_tensor_dim0_to_the_dp_degree():
    p = plan(gpus=4, zero=3)
    kv = next(t for t in SPEC.params if t.name.endswith("k_proj.weight"))
    assert local_numel(kv, p) == 16 * 128 and unsharded_numel(kv, p) == 64 * 128
    odd = plan(gpus=3, zero=3)
    assert local_numel(kv, odd) == 22 * 128 and unsharded_numel(kv, odd) == 66 * 128


def test_fsdp_gather_and_reduce_dtypes_under_mixed_precision():
    p = plan(gpus=2, zero=3, precision="bf16-mixed")
    assert comm.layer_unsharded_bytes(SPEC, p) == LAYER * 2  # param_dtype bf16
    assert comm.layer_reduce_scatter_input_bytes(SPEC, p) == LAYER * 4  # reduce_dtype fp32
    assert comm.root_unsharded_bytes(SPEC, p) == ROOT * 2
    assert compute_plan(p).precision is Precision.BF16 and compute_plan(p).gpus == 1


def test_fsdp_forward_keeps_the_last_all_gather_output_through_the_loss():
    z3, z2 = plan(gpus=2, zero=3), plan(gpus=2, zero=2)
    a, r = LAYER * 4, ROOT * 4
    assert comm.forward_gather_bytes(SPEC, z3, in_layer=False) == r + a
    assert comm.forward_gather_bytes(SPEC, z3, in_layer=True) == r + 2 * a
    assert comm.forward_gather_bytes(SPEC, z2, in_layer=False) == r + 3 * a


def test_fsdp_backward_prefetches_one_layer_under_zero3():
    z3 = plan(gpus=2, zero=3)
    a, r = LAYER * 4, ROOT * 4
    assert comm.backward_gather_bytes(SPEC, z3, None) == r + a  # root pre-backward prefetches the last layer
    assert comm.backward_gather_bytes(SPEC, z3, 1) == r + 2 * a  # own + prefetched layer 0
    assert comm.backward_gather_bytes(SPEC, z3, 0) == r + a
    assert comm.backward_gather_bytes(SPEC, z3, 1, own=False) == r + a


def test_tp_shards_heads_and_mlp_but_not_embeddings():
    p = plan(gpus=2, tp=2)
    by = {t.name.split(".")[-2] if t.layer is not None else t.name: t for t in SPEC.params}
    assert local_numel(by["q_proj"], p) == 64 * 128
    assert local_numel(by["down_proj"], p) == 128 * 176
    emb = SPEC.outer_params[0]
    assert local_numel(emb, p) == emb.numel


def test_multirank_estimates_shrink_with_sharding():
    peaks = {z: estimate(SPEC, plan(gpus=4, zero=z)).peak_bytes for z in (0, 1, 2, 3)}
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]
