"""Layer kinds (`llmem.derive.kinds`): decoder layers grouped by what they save and what their backward allocates,
each layer counted by its own kind; a Gemma 3 (five sliding-window layers, then one full-attention layer) estimated
against a real CPU run of one rank (`measure_rank`) and of two (gloo), within 1%."""

import itertools

import pytest

from llmem.components import activations as act
from llmem.derive.fit import REGIMES
from llmem.derive.kinds import group, peak_candidates
from llmem.derive.trace import Trace
from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.derive.configs import config

TOLERANCE = 0.01
GEMMA3 = config("gemma3_text", num_hidden_layers=6, sliding_window=16)  # layer 5 full attention, 0-4 sliding


def test_an_event_another_dominates_coefficient_by_coefficient_is_no_peak_candidate():
    events = [("a", (1, 0, 0, 0, 0, 10)), ("b", (2, 0, 0, 0, 0, 10)), ("c", (0, 0, 0, 0, 0, 50)),
              ("d", (2, 0, 0, 0, 0, 10)), ("e", (3, -1, 0, 0, 0, 10))]
    assert [n for n, _ in peak_candidates(events)] == ["b", "c", "e"]


def _trace(b: int, s: int) -> Trace:
    """Three layers: 0 and 2 save a b·s tensor, 1 also a b·s² one; 2's backward peaks like 0's."""
    plain, wide = [("model.layers.N.mlp: mm torch.float32", 4 * b * s)], [("model.layers.N.attn: bmm", b * s * s)]
    window = [("layer output gradient", 4 * b * s), ("event 0", 8 * b * s), ("event 1", 2 * b * s)]
    forward = [("event 0", 4 * b * s), ("event 1", 6 * b * s)]
    accumulated = [("layer output gradient", 4 * b * s), ("event 0", 6 * b * s), ("event 1", 2 * b * s)]
    return Trace([plain, plain + wide, plain], [], [], [], [], backwards=[window, window, window],
                 forwards=[forward, forward, forward], accumulating=[accumulated] * 3)


def test_layers_that_save_the_same_are_one_kind_whatever_their_index():
    points, checks, _ = REGIMES["batched"]
    kinds, layer_kinds = group([_trace(*p) for p in points], [_trace(*p) for p in checks], "batched", 0)
    assert layer_kinds == [0, 1, 0]
    assert [len(k["layer"]) for k in kinds] == [1, 2]
    assert kinds[0]["backward"] == [("event 0", [8, 0, 0, 0, 0, 0])]  # the others are below it everywhere
    assert kinds[0]["accumulating"] == [("event 0", [6, 0, 0, 0, 0, 0])]  # (a later micro-step's window)


def test_gemma3_full_attention_layer_is_a_kind_of_its_own_and_the_forward_sums_each_layer():
    spec, plan = ModelSpec.from_config(GEMMA3), TrainingPlan(device="cpu", batch_size=2, seq_len=64)
    kinds = spec.derived.layer_kinds(plan)
    assert kinds[5] not in kinds[:5]
    sliding, full = (act.layer_activation_bytes(act.layer_spec(spec, plan, k), plan) for k in (1, 5))
    assert sliding != full  # fp32 sdpa: a sliding layer's attention takes an explicit mask (bytes: the measured
    # tests below, `test_gemma3_two_ranks` and the heavy grids)
    assert act.kept_layers_bytes(spec, plan, 6) == sum(
        act.layer_activation_bytes(act.layer_spec(spec, plan, k), plan) for k in range(6))


@pytest.mark.slow
@pytest.mark.heavy
def test_the_checkpointing_planner_estimates_every_k_of_layers_of_several_kinds():
    from llmem import checkpointing
    from tests.test_ckpt_walk import old_plan_checkpointing

    spec, plan = ModelSpec.from_config(GEMMA3), TrainingPlan(device="cpu", batch_size=2, seq_len=64, grad_ckpt="full")
    none, full = (estimate(spec, plan.with_(grad_ckpt=c)).device_total_bytes for c in ("none", "full"))
    capacity = (none + full) // 2
    assert checkpointing.plan_checkpointing(spec, plan, capacity).to_dict() == \
        old_plan_checkpointing(spec, plan, capacity).to_dict()


def _single(**plan) -> None:
    p = TrainingPlan(device="cpu", **plan)
    est = estimate(ModelSpec.from_config(GEMMA3), p).peak_bytes
    measured = measure_rank(GEMMA3, p)["peak_bytes"]
    assert abs(est - measured) <= TOLERANCE * measured, f"{est:,} vs {measured:,}"


def test_gemma3_with_two_full_attention_layers_frees_their_rope_tables_in_the_lower_ones_backward():
    """14 layers (full attention at 5 and 11, traced as a 13-layer prefix: `llmem.derive.depth`): the full layers'
    RoPE cos/sin are shared, so outside the layers, and gone once layer 5's backward ran; the estimate peaks in
    layer 0's backward."""
    cfg = config("gemma3_text", num_hidden_layers=14, sliding_window=16)
    spec, plan = ModelSpec.from_config(cfg), TrainingPlan(device="cpu", batch_size=2, seq_len=64, grad_ckpt="full")
    assert spec.derived._shallower()[0]["num_hidden_layers"] == 13
    rope = 2 * 64 * 16 * 4  # cos and sin: seq x head_dim fp32
    assert [spec.derived.outer_released_bytes(plan, k) for k in (0, 4, 5, 13)] == [rope, rope, 0, 0]
    est = estimate(spec, plan).peak_bytes
    measured = measure_rank(cfg, plan)["peak_bytes"]
    assert abs(est - measured) <= 0.001 * measured, f"{est:,} vs {measured:,}"


_BASE = dict(batch_size=2, seq_len=64, gpus=2)
_QUICK = {"zero3 fp32 sdpa full": dict(zero=3, precision="fp32", grad_ckpt="full")}  # peaks in layer 1's backward
_GRID = {f"{scheme} {prec} {attn} {ckpt}": dict(zero=zero, precision=prec, attn=attn, grad_ckpt=ckpt[:4],
                                                ckpt_every=2 if ckpt == "full every 2" else 1)
         for (scheme, zero), prec, attn, ckpt in itertools.product(
             [("ddp", 0), ("zero3", 3)], ["fp32", "bf16-mixed", "bf16"], ["sdpa", "eager"],
             ["none", "full", "full every 2"])}
QUICK = TwoRankRows(_BASE, _QUICK, lambda name: GEMMA3, sampled=())  # the suite's d2-gemma3-derived-zero3-ckpt
GRID = TwoRankRows(_BASE, _GRID, lambda name: GEMMA3)


@pytest.mark.parametrize("name", list(_QUICK))
def test_gemma3_two_ranks(name):
    QUICK.check(name, TOLERANCE)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("precision, attn, ckpt, every", list(itertools.product(
    ["fp32", "bf16-mixed", "bf16"], ["sdpa", "eager"], ["none", "full"], [1, 2])))
def test_gemma3_single_device_grid(precision, attn, ckpt, every):
    if ckpt == "none" and every == 2:
        pytest.skip("--ckpt-every needs checkpointing")
    _single(batch_size=2, seq_len=64, precision=precision, attn=attn, grad_ckpt=ckpt, ckpt_every=every)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("name", list(_GRID))
def test_gemma3_two_ranks_grid(name):
    GRID.check(name, TOLERANCE)


def test_a_prefix_with_every_layer_role_is_traced_instead_of_the_full_depth():
    from llmem.derive.depth import expand, plan_depth

    s, f = ("sliding",), ("full",)
    gemma_1b = ([s] * 5 + [f]) * 4 + [s] * 2  # 26 layers: full attention at 5, 11, 17, 23
    d, mapping = plan_depth("gemma3_text", gemma_1b)
    assert d == 13  # two full-attention layers (shared tensors stay shared), ending in a sliding layer
    assert mapping[:6] == [0, 1, 1, 1, 1, 5] and mapping[11] == mapping[23] == 11 and mapping[25] == 12
    assert plan_depth("gemma3_text", [s] * 5 + [f]) is None  # the one full layer is also the last
    assert plan_depth("olmo3", gemma_1b) is None  # not verified against full-depth traces
    fits = {"layer_kinds": [0, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 3, 4], "held_layers": [[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12],
                                                                                    [5, 11]],
            "outer_layers": [[], [5, 11]]}
    full = expand(fits, mapping)
    assert full["layer_kinds"][23] == 3 and full["layer_kinds"][5] == 2 and full["layer_kinds"][25] == 4
    assert full["held_layers"][1] == full["outer_layers"][1] == [5, 11, 17, 23] and full["outer_layers"][0] == []


def test_a_prefix_table_naming_its_own_layer_expands_to_one_kind_per_full_layer_as_the_full_trace_groups_it():
    """A name holding the decoder layer's own path (OPT's `model.decoder.layers.1: native_dropout[1]`: the index is
    not one `kinds.saver` replaces) makes every full layer a kind of its own in a full-depth trace; the prefix's
    tables expand to the same kinds, names and per-kind checkpointed windows (`scripts/check_depth.py` compares
    the two traces to the byte)."""
    from llmem.derive.depth import expand

    def kind(path: str, c: int) -> dict:
        return {"layer": [(f"{path}: native_dropout[1] torch.bool", [0, 0, c, 0, 0, 0])],
                "backward": [("event 1", [0, 0, c, 0, 0, 0])], "forward": [], "accumulating": []}

    paths = ["model.decoder.layers.0", "model.decoder.layers.1", "model.decoder.layers.2"]
    fits = {"kinds": [kind(p, 64) for p in paths], "layer_kinds": [0, 1, 2], "held_layers": [[0, 1, 2]],
            "outer_layers": [[2]], "outer": [("model.decoder.layers.2.fc1: mm torch.float32", [0] * 6)],
            "final": [], "head": [], "held": [("layer argument (2-d torch.int64)", [0] * 6)],
            "checkpointed backward": [["w0"], ["w1"], ["w2"]]}
    full = expand(fits, [0, 1, 1, 1, 2], paths)
    assert full["layer_kinds"] == [0, 1, 2, 3, 4]
    assert [k["layer"][0][0].split(":")[0] for k in full["kinds"]] == [f"model.decoder.layers.{i}" for i in range(5)]
    assert full["checkpointed backward"] == [["w0"], ["w1"], ["w1"], ["w1"], ["w2"]]
    assert full["outer"][0][0].startswith("model.decoder.layers.4.fc1:")  # first saved by the last layer
    assert full["held_layers"] == [[0, 1, 2, 3, 4]] and full["outer_layers"] == [[4]]
    fits["kinds"] = [kind("model.decoder.layers.N", 64)] * 3  # no layer path in the names: one kind
    assert expand(fits, [0, 1, 1, 1, 2], paths)["layer_kinds"] == [0, 0, 0, 0, 0]


def test_the_modules_a_layer_index_picks_are_a_layer_setting_so_dense_layers_keep_their_own_prefix_layers():
    """DeepSeek's dense first layers (`first_k_dense_replace`) and qwen3_moe's dense layers (`mlp_only_layers`,
    `decoder_sparse_step`) are picked by layer index in `DecoderLayer.__init__`, which no per-layer list shows: the
    layer's built parameters do (`layer_modules`), so each kind keeps a lowest and a repeated layer in the prefix
    (`scripts/check_depth.py` compares the prefix's traces with the full depth's, to the byte)."""
    from llmem.derive.depth import layer_modules, plan_depth
    from llmem.spec import ParamTensor

    dense, moe = ("dense",), ("experts",)
    assert plan_depth("deepseek_v3", [dense] * 3 + [moe] * 58) == (6, [0, 1, 1, 3] + [4] * 56 + [5])
    assert plan_depth("deepseek_v2", [dense] + [moe] * 26) == (4, [0, 1] + [2] * 24 + [3])
    d, mapping = plan_depth("qwen3_moe", [dense, moe] * 24)  # decoder_sparse_step 2
    assert d == 6 and mapping[:6] == [0, 1, 2, 3, 2, 3] and mapping[-1] == 5
    assert plan_depth("qwen3_moe", [moe] * 48) == (3, [0] + [1] * 46 + [2])
    assert plan_depth("mixtral", [()] * 32) == (3, [0] + [1] * 30 + [2])
    params = [ParamTensor("model.embed_tokens.weight", (8, 4)),
              ParamTensor("model.layers.0.mlp.down_proj.weight", (4, 16), 0),
              ParamTensor("model.layers.1.mlp.experts.down_proj", (2, 4, 8), 1),
              ParamTensor("model.layers.2.mlp.experts.down_proj", (2, 4, 8), 2)]
    modules = layer_modules(params, 3)
    assert modules[0] != modules[1] == modules[2] and "mlp.experts.down_proj" in modules[1][0]


def test_a_qwen3_moe_config_with_dense_layers_traces_a_prefix_built_as_the_full_models_first_layers():
    from llmem.derive.tables import Derived
    from tests.derive.configs import config

    cfg = config("qwen3_moe", num_hidden_layers=12, mlp_only_layers=[0, 3])
    prefix, mapping = Derived(cfg, "qwen3_moe")._shallower()
    assert prefix["num_hidden_layers"] == 5 and prefix["mlp_only_layers"] == [0, 3]
    assert mapping == [0, 1, 2, 3] + [2] * 7 + [4]
