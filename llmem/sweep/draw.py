"""Random training plans over every option the estimator accepts (pure, torch-free).

Plan `i` of seed `s` comes from its own generator seeded with "s:i", so a draw does not depend on how many plans are
drawn, and a resumed sweep draws the same plans. Options are drawn independently except where one option only has
a meaning given another (the ZeRO stage given the GPU count and TP degree, the optimizer implementation given the
optimizer, the quantization given the method, `ckpt_every` given checkpointing, LoRA's options given LoRA): every
other combination the estimator refuses is kept, and its refusal recorded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmem.choices import PpSchedule
from llmem.errors import InputError
from llmem.options import BY_NAME
from llmem.plan import GradCkpt, Loss, Method, Offload, Optimizer, OptimizerImpl, Precision, Quant, TrainingPlan
from llmem.sweep import ds_lora
from llmem.sweep.act_offload import draw_activation_offload
from llmem.sweep.cp import draw_cp
from llmem.sweep.lora_dtype import draw_lora_adapter_dtype
from llmem.sweep.lora_tp import draw_lora_tp
from llmem.sweep.models import lora_targets, models, tp_capable
from llmem.sweep.tiny_vocab import draw_tiny_vocab

MAX_GPUS = {"small": 4, "derived": 4, "full": 16}
BATCH = {"small": (1, 2, 4), "derived": (1, 2, 4), "full": (1, 2, 4, 8)}
SEQ = {"small": (32, 64, 128), "derived": (32, 64, 128), "full": (512, 1024, 2048, 4096)}
GPU_COUNTS = {"small": (1, 2, 3, 4), "derived": (1, 2, 3, 4), "full": (1, 2, 4, 8, 16)}
CKPT_EVERY = (1, 2, 3)
GRAD_ACCUM = (1, 2, 3)
LORA_RANK = (4, 8, 16)
LORA_DROPOUT = (0.0, 0.05, 0.1)
MODULES_TO_SAVE = ("", "", "lm_head", "embed_tokens", "lm_head,embed_tokens")
# Options that leave the GPU or need CUDA kernels: drawn less often (the cpu profile refuses them all).
OFFLOAD = ((Offload.NONE, 6), (Offload.OPTIMIZER, 1), (Offload.OPTIMIZER_PARAMS, 1))
LOSS = ((Loss.STANDARD, 6), (Loss.FUSED_LINEAR_CE, 1))
METHOD = ((Method.FULL, 2), (Method.LORA, 2), (Method.QLORA, 1))


@dataclass(frozen=True)
class Draw:
    """One drawn plan: its index, the model's name and config, and the plan's fields (TrainingPlan keywords)."""

    index: int
    model: str
    config: dict
    fields: dict

    def plan(self) -> TrainingPlan:
        """The TrainingPlan, or InputError naming the field the plan refuses."""
        return TrainingPlan(**self.fields)

    def refusal(self) -> InputError | None:
        try:
            self.plan()
        except InputError as exc:
            return exc
        return None


def _weighted(rng: random.Random, pairs) -> object:
    values, weights = zip(*pairs, strict=True)
    return rng.choices(values, weights=weights)[0]


def _enum(rng: random.Random, option: str) -> str:
    """One of the option's values (`llmem.options`), uniformly."""
    return rng.choice(BY_NAME[option].values)


def draw_layout(rng: random.Random, size: str, tp_ok: bool) -> dict:
    """GPU count, TP degree and ZeRO stage, drawn so that the triple is one of the schemes of DESIGN.md §2."""
    gpus = rng.choice(GPU_COUNTS[size])
    degrees = [d for d in range(1, gpus + 1) if gpus % d == 0 and (d == 1 or tp_ok)]
    tp = rng.choice(degrees)
    if gpus == 1 or tp == gpus:
        zero = 0
    elif tp > 1:
        zero = 3
    else:
        zero = rng.choice((0, 1, 2, 3))
    return {"gpus": gpus, "tp": tp, "zero": zero}


def draw_optimizer(rng: random.Random) -> dict:
    optimizer = _enum(rng, "optimizer")
    if optimizer in (Optimizer.ADAMW8BIT.value, Optimizer.PAGED_ADAMW8BIT.value):
        impl = OptimizerImpl.DEFAULT.value  # bitsandbytes' own kernels
    elif optimizer == Optimizer.ADAFACTOR.value:
        impl = rng.choice([m.value for m in OptimizerImpl if m is not OptimizerImpl.FUSED])
    else:
        impl = _enum(rng, "optimizer_impl")
    return {"optimizer": optimizer, "optimizer_impl": impl}


def draw_method(rng: random.Random, config: dict) -> dict:
    method = _weighted(rng, METHOD).value
    if method == Method.FULL.value:
        return {"method": method}
    out = {"method": method, "lora_rank": rng.choice(LORA_RANK), "lora_dropout": rng.choice(LORA_DROPOUT),
           "lora_targets": rng.choice(lora_targets(config)), "lora_modules_to_save": rng.choice(MODULES_TO_SAVE)}
    out["lora_alpha"] = 2 * out["lora_rank"]
    if method == Method.QLORA.value:
        out["quant"] = rng.choice([q.value for q in Quant if q is not Quant.NONE])
        if out["quant"] in (Quant.NF4.value, Quant.FP4.value):
            out["double_quant"] = rng.random() < 0.5
    return out


def draw_checkpointing(rng: random.Random) -> dict:
    """none or full (the draws of the first sweeps; `selective` replaces some of them from a stream of its own in
    `draw_later_options`), and K given full."""
    grad_ckpt = rng.choice((GradCkpt.NONE.value, GradCkpt.FULL.value))
    every = rng.choice(CKPT_EVERY) if grad_ckpt == GradCkpt.FULL.value else 1
    return {"grad_ckpt": grad_ckpt, "ckpt_every": every}


def draw_one(seed: int, index: int, size: str, device: str, names: list[str] | None = None) -> Draw:
    """Plan `index` of the sweep seeded `seed`, on the `device` profile, over the models of `size`."""
    catalogue = models(size)
    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(sorted(names or catalogue))
    config = draw_tiny_vocab(seed, index, catalogue[name], size)  # V = h in a share (its own stream)
    fields = {**draw_layout(rng, size, tp_capable(config)),
              "batch_size": rng.choice(BATCH[size]), "seq_len": rng.choice(SEQ[size]),
              "precision": _enum(rng, "precision"), **draw_optimizer(rng), **draw_checkpointing(rng),
              "attn": _enum(rng, "attn"), **draw_method(rng, config), "grad_accum": rng.choice(GRAD_ACCUM),
              "offload": _weighted(rng, OFFLOAD).value, "loss": _weighted(rng, LOSS).value, "device": device}
    fields |= draw_later_options(seed, index, fields, device, _lora_tables(config))
    fields |= draw_lora_tp(seed, index, fields, device)  # LoRA + TP where it runs (a stream of its own)
    if pipeline := draw_pipeline(seed, index, fields, config):  # full fine-tuning (or LoRA where it is modelled)
        if pipeline["method"] == Method.LORA.value and _idle_rank(pipeline, config):  # no adapter on a rank
            pipeline = {k: v for k, v in pipeline.items() if k != "lora_modules_to_save"} | {"method": "full"}
        kept = _LORA_OPTIONS if pipeline["method"] == Method.LORA.value else ()  # its other options dropped
        fields = {k: v for k, v in fields.items() if k not in _NOT_PIPELINED or k in kept} | pipeline
    fields |= draw_cp(seed, index, fields, config)
    fields |= draw_activation_offload(seed, index, fields, config)  # cuda profile, where it runs (its own stream)
    fields |= draw_lora_adapter_dtype(seed, index, fields, _lora_tables(config))  # bf16 LoRA (own stream)
    fields |= draw_no_sync(seed, index, fields)  # accumulation without syncing (own stream)
    return Draw(index, name, config, fields)


def draw_no_sync(seed: int, index: int, fields: dict) -> dict:
    """`--no-sync` (a stream of its own) in `NO_SYNC_SHARE` of the plans that take it: --grad-accum > 1 on several
    GPUs under a data-parallel scheme the support rows allow (`llmem.support_no_sync`); a plan refused for another
    reason draws nothing."""
    if fields.get("grad_accum", 1) < 2 or fields["gpus"] < 2 \
            or random.Random(f"{seed}:{index}:no-sync").random() >= NO_SYNC_SHARE:
        return {}
    try:
        TrainingPlan(**{**fields, "no_sync": True})
    except InputError:
        return {}
    return {"no_sync": True}


def _idle_rank(pipeline: dict, config: dict) -> bool:
    """Whether a rank of the drawn pipeline holds no decoder layer (`components.pipeline.check` refuses LoRA there)."""
    from llmem.components.pipeline import stage_layer_counts

    pp, v = pipeline["pp"], pipeline.get("pp_stages_per_rank", 1)
    try:
        counts = stage_layer_counts(int(config.get("num_hidden_layers", 0)), pp * v)
    except InputError:  # a split with empty stages: the estimator refuses it, and the sweep records that
        return False
    return any(not sum(counts[r + k * pp] for k in range(v)) for r in range(pp))


_LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
_NOT_PIPELINED = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_modules_to_save", "quant",
                  "double_quant", "loss_chunks", "float8")


def draw_later_options(seed: int, index: int, fields: dict, device: str, lora_tables: bool = False) -> dict:
    """Options added after the first sweeps, from a stream of their own so that every earlier draw stays the same:
    the FSDP2 shard dim under ZeRO-2/3, DDP's gradient bucket views under DDP/ZeRO-1 (on the cpu profile only: the
    simulate oracle, the cuda profile's, does not run a Reducer), --keep-grads (a stream of its own too),
    `--engine fsdp1` under ZeRO-0/2/3 (cuda profile: ZeRO-0/3, which the simulate oracle runs; a stream of its
    own; LoRA too on the cpu profile where `lora_tables`: `_fsdp1_runs`), which replaces the FSDP2 shard dim and
    DDP's bucket views and draws one micro-step, gradients freed,
    --grad-ckpt selective in a third of the full fine-tunes checkpointing every layer without TP, --loss chunked-ce
    where the engine is torch, and --optimizer-in-backward where the plan runs it (each from a stream of its own);
    `--engine deepspeed` in half of the cpu profile's other ZeRO-0/1/2 plans it is modelled for (`_draw_deepspeed`)."""
    rng = random.Random(f"{seed}:{index}:later")
    out = {}
    if fields["gpus"] > 1 and fields["tp"] == 1 and fields["zero"] in (2, 3):
        out["fsdp_shard"] = _enum(rng, "fsdp_shard")
    if fields["gpus"] > 1 and fields["tp"] == 1 and fields["zero"] in (0, 1) and device == "cpu":
        out["ddp_bucket_view"] = rng.random() < 0.5
    out["keep_grads"] = random.Random(f"{seed}:{index}:keep-grads").random() < KEEP_GRADS_SHARE
    stages = (0, 2, 3) if device == "cpu" else (0, 3)  # the simulate oracle does not run SHARD_GRAD_OP
    if fields["gpus"] > 1 and fields["tp"] == 1 and fields["zero"] in stages \
            and _fsdp1_runs(fields | out, lora_tables and device == "cpu") \
            and random.Random(f"{seed}:{index}:engine").random() < FSDP1_SHARE:
        out.pop("fsdp_shard", None)
        out.pop("ddp_bucket_view", None)
        out |= {"engine": "fsdp1", "grad_accum": 1, "keep_grads": False}
    out |= _draw_deepspeed(seed, index, fields | out, device)
    if fields["grad_ckpt"] != GradCkpt.NONE.value and fields["ckpt_every"] == 1 and "engine" not in out \
            and fields["method"] == Method.FULL.value and fields["tp"] == 1 \
            and random.Random(f"{seed}:{index}:selective").random() < SELECTIVE_SHARE:
        out["grad_ckpt"] = GradCkpt.SELECTIVE.value  # --grad-ckpt selective: a third of the fully checkpointed plans
    chunked = random.Random(f"{seed}:{index}:chunked-ce")
    if fields["loss"] == Loss.STANDARD.value and chunked.random() < CHUNKED_CE_SHARE and "engine" not in out:
        out |= {"loss": Loss.CHUNKED_CE.value, "loss_chunks": chunked.choice(LOSS_CHUNKS)}
    if in_backward_runs({**fields, **out}):  # --optimizer-in-backward, where the plan runs it (its own stream)
        out["optimizer_in_backward"] = random.Random(f"{seed}:{index}:in-backward").random() < IN_BACKWARD_SHARE
    out |= draw_float8(seed, index, fields | out)
    return out


def draw_float8(seed: int, index: int, fields: dict) -> dict:
    """`--float8 tensorwise|rowwise` (a stream of its own), in a share of the full fine-tunes in bf16 compute (pure
    bf16; bf16-mixed under FSDP2) without TP, pipelines or another engine, with the plan's other options set to what
    float8 is modelled with (`llmem.support_float8`: no checkpointing, one micro-step, gradients freed after the
    step, the standard loss, no offload or bucket views); the model's own condition (a dense llama-like family with
    down_proj converted, `components.float8.check`) is left to the estimator, which records its refusal."""
    rng = random.Random(f"{seed}:{index}:float8")
    bf16 = fields["precision"] == Precision.BF16.value or (
        fields["precision"] == Precision.BF16_MIXED.value and fields["gpus"] > 1 and fields["zero"] in (2, 3))
    if not (bf16 and fields["method"] == Method.FULL.value and fields["tp"] == 1 and "engine" not in fields
            and "pp" not in fields) or rng.random() >= FLOAT8_SHARE:
        return {}
    return {"float8": rng.choice(("tensorwise", "rowwise")), "grad_ckpt": GradCkpt.NONE.value, "ckpt_every": 1,
            "grad_accum": 1, "keep_grads": False, "optimizer_in_backward": False, "offload": Offload.NONE.value,
            "loss": Loss.STANDARD.value, "loss_chunks": 8, "ddp_bucket_view": False}


FLOAT8_SHARE = 0.5




def draw_pipeline(seed: int, index: int, fields: dict, config: dict) -> dict:
    """`--pp`, from a stream of its own: in a share of the multi-GPU plans drawn as DDP or FSDP2 ZeRO-3 (tp 1, the
    torch engine) of a model with a pipeline split (`Family.pipeline_stages`, untied, dense) pipeline
    stages (`_draw_pp`: one per GPU, or with data parallelism beside them; FSDP2: pure precision), a schedule (the
    looped one from a stream of its own, with 2 or 3 stages per GPU where the split has them), and a microbatch
    count dividing the batch that the schedule runs; the plan's other options are set to what the pipeline is
    modelled with (`llmem.support`'s pp rows: full fine-tuning, or LoRA with one stage per GPU and no module copies;
    sdpa, adamw or sgd, no or full checkpointing of every layer, one micro-step, the standard loss, no offload)."""
    from llmem.families import has_trait

    rng = random.Random(f"{seed}:{index}:pipeline")
    modelled = has_trait(config.get("model_type"), "pipeline_stages") and not config.get("tie_word_embeddings", False)
    if fields["gpus"] < 2 or fields["tp"] != 1 or fields["zero"] not in (0, 3) or "engine" in fields \
            or rng.random() >= PP_SHARE or not modelled:
        return {}
    pp, batch = _draw_pp(seed, index, fields), fields["batch_size"]
    if not pp:
        return {}
    schedule = rng.choice((PpSchedule.GPIPE.value, PpSchedule.ONE_F_ONE_B.value))
    out = {"pp": pp, "pp_schedule": schedule, "method": Method.FULL.value, "attn": "sdpa",
           "optimizer": fields["optimizer"] if fields["optimizer"] in ("adamw", "sgd") else "adamw",
           "grad_ckpt": "full" if fields["grad_ckpt"] != "none" else "none", "ckpt_every": 1, "grad_accum": 1,
           "loss": Loss.STANDARD.value, "offload": Offload.NONE.value, "keep_grads": False,
           "optimizer_in_backward": False, "ddp_bucket_view": False}
    if out["optimizer"] != fields["optimizer"]:
        out["optimizer_impl"] = "default"
    if fields.get("method") == Method.LORA.value and pp == fields["gpus"]:  # LoRA on one stage per GPU (support_pp)
        out |= {"method": Method.LORA.value, "lora_modules_to_save": ""}
    if pp < fields["gpus"]:  # data parallelism beside the stages (`llmem.support`): DDP runs 1F1B with M > pp,
        # FSDP2 pure precision with one stage per GPU
        out |= {"fsdp_shard": "dim0", "attn": fields["attn"]}  # (lone pipelines keep sdpa: seeds 11-15's plans)
        if fields["zero"] == 3:
            out["precision"] = fields["precision"].replace("-mixed", "")
        else:
            out["pp_schedule"] = PpSchedule.ONE_F_ONE_B.value
        for schedule in (out["pp_schedule"], PpSchedule.GPIPE.value):  # FSDP2's 1F1B on a small batch: GPipe's
            divisors = [m for m in range(1, batch + 1)
                        if _schedule_runs(schedule, pp, batch, m, fields["gpus"], fields["zero"])]
            if divisors:
                return out | {"pp_schedule": schedule, "microbatches": rng.choice(divisors)}
        return {}
    looped = random.Random(f"{seed}:{index}:interleaved")
    layers = int(config.get("num_hidden_layers", 0))
    stages = [v for v in (2, 3) if pp * v <= layers + 2]
    if stages and looped.random() < INTERLEAVED_SHARE:
        out |= {"pp_schedule": PpSchedule.INTERLEAVED_1F1B.value, "pp_stages_per_rank": looped.choice(stages)}
    divisors = [m for m in range(1, batch + 1) if _schedule_runs(out["pp_schedule"], pp, batch, m)]
    if not divisors:  # 1F1B on a batch smaller than the stages: GPipe runs it
        out["pp_schedule"], divisors = PpSchedule.GPIPE.value, [m for m in range(1, batch + 1) if batch % m == 0]
    return out | {"microbatches": rng.choice(divisors)}


def _draw_pp(seed: int, index: int, fields: dict) -> int:
    """The pipeline degree, from a stream of its own: DDP plans keep one stage per GPU but in `DP_SHARE` of them,
    which (like every FSDP2 plan) draw a proper divisor of the GPU count, leaving a data-parallel group of 2 or
    more ranks per stage; 0 where the GPU count has none."""
    gpus, rng = fields["gpus"], random.Random(f"{seed}:{index}:pipeline-dp")
    if fields["zero"] == 0 and rng.random() >= DP_SHARE:
        return gpus
    ddp = fields["zero"] == 0  # DDP beside the stages runs 1F1B with more microbatches than stages
    degrees = [d for d in range(2, gpus) if gpus % d == 0 and gpus // d >= 2 and (fields["batch_size"] > d or not ddp)]
    return rng.choice(degrees) if degrees else (gpus if ddp else 0)


def _schedule_runs(schedule: str, pp: int, batch: int, microbatches: int, gpus: int = 0, zero: int = 0) -> bool:
    """Whether the support matrix's rows over the pipeline's own fields (and the GPU count and ZeRO stage beside
    them; default: one stage per GPU) accept `microbatches` (a divisor of the batch; 1F1B: at least the stages;
    interleaved: a multiple of its rounds; DDP beside the stages: 1F1B with more than the stages)."""
    from types import SimpleNamespace

    from llmem import support

    probe = SimpleNamespace(pp=pp, pp_schedule=PpSchedule(schedule), microbatches=microbatches, batch_size=batch,
                            gpus=gpus or pp, zero=zero)
    among = ("pp", "pp_schedule", "microbatches", "batch_size", "gpus", "zero")
    return support.first_refusal(probe, among=among) is None


PP_SHARE = 0.25  # --pp = the GPU count in a quarter of the multi-GPU DDP plans of a model with a pipeline split
DP_SHARE = 1 / 3  # of the DDP ones, data parallelism beside the stages (--gpus = pp × dp; every FSDP2 one)
INTERLEAVED_SHARE = 1 / 3  # of those, ScheduleInterleaved1F1B with 2 or 3 stages per GPU where the split has them


SELECTIVE_SHARE = 1 / 3
KEEP_GRADS_SHARE = 0.25  # --keep-grads (zero_grad(set_to_none=False)) in a quarter of the plans
NO_SYNC_SHARE = 0.5  # --no-sync in half of the plans that take it
CHUNKED_CE_SHARE = 0.15  # --loss chunked-ce in about one standard-loss plan in seven, from a stream of its own
LOSS_CHUNKS = (1, 2, 4, 8)
FSDP1_SHARE = 0.5  # --engine fsdp1 in half of the multi-GPU ZeRO-0/2/3 plans FSDP1 is modelled for
DEEPSPEED_SHARE = 0.5
DS_BUCKETS = (500_000_000, 1_000_000, 100_000, 20_000)  # DeepSpeed's default, then buckets below the models' size
DS_OVERLAP_SHARE = 0.5


def _draw_deepspeed(seed: int, index: int, fields: dict, device: str) -> dict:
    """`--engine deepspeed` (ZeRO-0/1/2, fp32 or bf16-mixed, full fine-tuning with a torch optimizer, or LoRA as
    `sweep.ds_lora` draws it; no offload, the standard loss, the plan's own micro-steps, gradients freed)
    in half of the cpu profile's plans it is modelled for that did not draw fsdp1, with a reduce bucket from
    DS_BUCKETS and, under ZeRO-1/2, overlap_comm in half of them (ZeRO-0 reads neither); from
    streams of their own. Not on the cuda profile: the full-size sweeps' seeds keep their draws (the simulator runs
    DeepSpeed since they were drawn)."""
    rng = random.Random(f"{seed}:{index}:deepspeed")
    lora = ds_lora.lora_modelled(fields) and _fsdp1_runs(fields, lora=True)
    if device != "cpu" or "engine" in fields or fields["gpus"] == 1 or fields["tp"] > 1 \
            or fields["zero"] not in (0, 1, 2) or fields["precision"] not in ("fp32", "bf16-mixed") \
            or not (_fsdp1_runs(fields) or lora) or rng.random() >= DEEPSPEED_SHARE:
        return {}
    bucket = rng.choice(DS_BUCKETS)
    overlap = fields["zero"] != 0 and random.Random(f"{seed}:{index}:ds-overlap").random() < DS_OVERLAP_SHARE
    return {"engine": "deepspeed", "keep_grads": False, "ds_reduce_bucket": bucket, "ds_overlap_comm": overlap,
            "fsdp_shard": "dim0", "ddp_bucket_view": False} | ds_lora.lora_settings(fields, overlap)


def _fsdp1_runs(fields: dict, lora: bool = False) -> bool:
    """Full fine-tuning, or with `lora` LoRA in fp32 or mixed precision without module copies (a half base beside
    PEFT's fp32 adapters cannot be flattened; `llmem.support`), with a torch optimizer, no offload, the standard
    loss: the plans `--engine fsdp1` is modelled for (drawn with one micro-step and gradients freed); elsewhere it
    would only add refusals."""
    lora_runs = lora and fields["method"] == Method.LORA.value and not fields.get("lora_modules_to_save") \
        and fields["precision"] not in (Precision.BF16.value, Precision.FP16.value)
    return ((fields["method"] == Method.FULL.value or lora_runs) and fields["offload"] == Offload.NONE.value
            and fields["loss"] == Loss.STANDARD.value
            and fields["optimizer"] in (Optimizer.ADAMW.value, Optimizer.SGD.value))


def _lora_tables(config: dict) -> bool:
    """LoRA under FSDP1 is modelled on the hand-written dense families' LoRA tables (`llmem.estimate`); LoRA on
    several GPUs is refused on MoE models. Drawn on the cpu profile only: under the simulate oracle (cuda profile)
    a tied-embedding model's FSDP1 LoRA run fails (docs/MODEL-FSDP1.md)."""
    from llmem.families import FAMILIES

    family = FAMILIES.get(str(config.get("model_type")))
    moe = any(k in config for k in ("num_local_experts", "num_experts"))
    return family is not None and family.lora_activations and not moe
IN_BACKWARD_SHARE = 0.5  # --optimizer-in-backward in half of the plans that can run it


def in_backward_runs(fields: dict) -> bool:
    """Whether `--optimizer-in-backward` is modelled for the drawn plan (`llmem.support`'s rows for it): one GPU,
    no accumulation, no kept gradients, torch's adamw, sgd or adafactor, no offload, the standard loss."""
    return (fields["gpus"] == 1 and fields["grad_accum"] == 1 and not fields.get("keep_grads")
            and fields["optimizer"] in ("adamw", "sgd", "adafactor") and fields["offload"] == "none"
            and fields["loss"] == "standard")


def draw(n: int, seed: int, size: str = "small", device: str = "cpu", start: int = 0) -> list[Draw]:
    return [draw_one(seed, i, size, device) for i in range(start, start + n)]
