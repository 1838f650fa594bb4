"""Checkpointed layers keep the model forward's position_ids alive until layer 0's backward (a real run)."""

import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmem.components import activations as act  # noqa: E402
from llmem.plan import TrainingPlan  # noqa: E402
from llmem.spec import ModelSpec  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}


def _held_at_first_layer_backward(ckpt: bool) -> tuple[bool, int]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG))
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen, alive = {}, {}
    layer0 = model.model.layers[0]
    layer0.register_forward_pre_hook(
        lambda m, a, kw: seen.update(ref=weakref.ref(kw["position_ids"]), nbytes=kw["position_ids"].nbytes),
        with_kwargs=True)
    layer0.register_full_backward_pre_hook(lambda *_: alive.update(v=seen["ref"]() is not None))
    ids = torch.randint(0, 128, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    return alive["v"], seen["nbytes"]


def test_position_ids_held_only_under_checkpointing():
    held, nbytes = _held_at_first_layer_backward(ckpt=True)
    assert held
    assert not _held_at_first_layer_backward(ckpt=False)[0]
    spec = ModelSpec.from_config(CONFIG)
    named = {s.name: s.bytes for s in act.outer_saved(spec, TrainingPlan(batch_size=2, seq_len=32, grad_ckpt="full"))}
    assert named["position_ids (held by the checkpointed layers' inputs)"] == nbytes
    plain = {s.name for s in act.outer_saved(spec, TrainingPlan(batch_size=2, seq_len=32))}
    assert not any(n.startswith("position_ids") for n in plain)


def _mask_held_at_first_layer_backward(ckpt: bool) -> tuple[bool, int, torch.dtype]:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen, alive = {}, {}
    layer0 = model.model.layers[0]
    layer0.register_forward_pre_hook(
        lambda m, a, kw: seen.update(ref=weakref.ref(kw["attention_mask"]), nbytes=kw["attention_mask"].nbytes,
                                     dtype=kw["attention_mask"].dtype), with_kwargs=True)
    layer0.register_full_backward_pre_hook(lambda *_: alive.update(v=seen["ref"]() is not None))
    ids = torch.randint(0, 128, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    return alive["v"], seen["nbytes"], seen["dtype"]


def test_eager_mask_held_only_under_checkpointing():
    """Eager attention's float causal mask is a kwarg of every layer call: the checkpoint keeps it for the
    recompute until layer 0's backward; without checkpointing nothing saves it."""
    held, nbytes, dtype = _mask_held_at_first_layer_backward(ckpt=True)
    assert held and dtype == torch.float32
    assert not _mask_held_at_first_layer_backward(ckpt=False)[0]
    spec = ModelSpec.from_config(CONFIG)
    plan = TrainingPlan(batch_size=2, seq_len=32, grad_ckpt="full", attn="eager", precision="fp32")
    named = {s.name: s.bytes for s in act.outer_saved(spec, plan)}
    assert named["eager causal mask (held by the checkpointed layers' kwargs)"] == nbytes
    for other in (plan.with_(attn="sdpa"), plan.with_(grad_ckpt="none")):
        assert not any("causal mask" in s.name for s in act.outer_saved(spec, other))


def test_gemma2_holds_two_masks_until_the_lowest_layer_taking_each():
    """gemma2 makes a sliding-window mask (even layers) and a full causal one (odd layers): under checkpointing both
    are alive at layer 1's backward, and the full one is gone by layer 0's (its only holder, layer 1, is done)."""
    import gc

    from llmem.sweep.models import SMALL

    torch.manual_seed(0)
    cfg = SMALL["gemma2"]
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), attn_implementation="eager")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    refs, alive = {}, {}

    def seen(i: int) -> None:  # a backward pre-hook that returns nothing (no replaced gradient)
        gc.collect()
        alive[i] = [refs[k][0]() is not None for k in sorted(refs)]

    def took(i: int, mask) -> None:  # a forward pre-hook that returns nothing (no replaced arguments)
        refs.setdefault(i, (weakref.ref(mask), mask.nbytes, mask.data_ptr()))

    for i, layer in enumerate(model.model.layers[:2]):
        layer.register_forward_pre_hook(lambda m, a, kw, i=i: took(i, kw["attention_mask"]), with_kwargs=True)
        layer.register_full_backward_pre_hook(lambda *_, i=i: seen(i))
    ids = torch.randint(0, cfg["vocab_size"], (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    assert refs[0][2] != refs[1][2]  # two masks, not one shared (both alive in forward)
    assert alive[1] == [True, True] and alive[0] == [True, False]
    spec = ModelSpec.from_config(cfg)
    plan = TrainingPlan(batch_size=2, seq_len=64, grad_ckpt="full", attn="eager", precision="fp32")
    masks = [s.bytes for s in act.outer_saved(spec, plan) if "mask" in s.name]
    assert masks == [refs[0][1], refs[1][1]]
    assert act.eager_mask_released_bytes(spec, plan, 0) == refs[1][1]
    assert act.eager_mask_released_bytes(spec, plan, 1) == 0
