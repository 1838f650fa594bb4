"""The README's speed table: the median time of one estimate per scheme and method on three presets, the plan new
every round (its sequence length never asked before), and of a 1–64-GPU `compare`. Any checkout of llmem can be
timed (`PYTHONPATH=<checkout> python scripts/bench_estimate.py`), so a change is measured before and after on the
same machine. Prints a markdown table (ms). `--clock cpu` times the process's CPU time (`time.process_time`): on a
shared, loaded machine the wall clock also counts the time other processes ran. `--first`: the first three
estimates of the DeepSpeed layouts on a new spec (walked, walked and traced, replayed) and the first LoRA trace of
an architecture without a table (`first_trace_s`)."""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

PLANS = {
    "1 GPU": {}, "DDP": {"gpus": 8}, "ZeRO-1": {"gpus": 8, "zero": 1}, "ZeRO-2": {"gpus": 8, "zero": 2},
    "ZeRO-3": {"gpus": 8, "zero": 3}, "ZeRO-3, `--grad-ckpt full`": {"gpus": 8, "zero": 3, "grad_ckpt": "full"},
    "TP 2 × ZeRO-3": {"gpus": 8, "tp": 2, "zero": 3},
    "DeepSpeed ZeRO-2": {"gpus": 8, "zero": 2, "engine": "deepspeed"},
    "DeepSpeed ZeRO-3": {"gpus": 8, "zero": 3, "engine": "deepspeed"},
    "FSDP1 FULL_SHARD": {"gpus": 8, "zero": 3, "engine": "fsdp1"},
    "PP 4 (1F1B, 4 microbatches)": {"gpus": 4, "pp": 4, "microbatches": 4, "batch_size": 4},
    "LoRA, 1 GPU": {"method": "lora"}, "LoRA, ZeRO-3": {"method": "lora", "gpus": 8, "zero": 3},
    "QLoRA nf4 (bf16), 1 GPU": {"method": "qlora", "quant": "nf4", "precision": "bf16"},
    "QLoRA nf4 (bf16), DDP": {"method": "qlora", "quant": "nf4", "precision": "bf16", "gpus": 8},
}
MODELS = ("llama-3.3-70b-instruct", "gemma-2-2b", "qwen3-30b-a3b")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def median_ms(spec, fields: dict, rounds: int) -> float | None:
    """Median of `rounds` estimates, each at a sequence length not asked before (None: the plan is refused)."""
    from llmem.errors import InputError
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan

    lengths = itertools.count(1024)
    try:
        estimate(spec, TrainingPlan(**fields))
    except InputError:
        return None
    times = []
    for _ in range(rounds):
        plan = TrainingPlan(**fields, seq_len=next(lengths))
        start = clock()
        estimate(spec, plan)
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def compare_ms(rounds: int) -> float:
    """A 1, 2, 4, ..., 64-GPU `compare` (every strategy, its max-batch solve) of llama-3.3-70b on an H100 80GB."""
    from llmem.compare import compare
    from llmem.gpus import get_gpu
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    spec, capacity = ModelSpec.from_config(load_preset("llama-3.3-70b-instruct")), get_gpu("h100-80gb").memory_bytes
    times = []
    for _ in range(rounds):
        start = clock()
        for n in (1, 2, 4, 8, 16, 32, 64):
            compare(spec, TrainingPlan(gpus=n), capacity)
        times.append(clock() - start)
    return statistics.median(times) * 1e3


FIRST = {"DeepSpeed ZeRO-2": {"gpus": 8, "zero": 2, "engine": "deepspeed"},
         "DeepSpeed ZeRO-3": {"gpus": 8, "zero": 3, "engine": "deepspeed"}}


def first_ms(model: str, fields: dict) -> list[float]:
    """The first three estimates of a layout on a new spec (three sequence lengths): walked, walked and traced on
    symbols (`llmem.walk.replay`), replayed."""
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    spec, out = ModelSpec.from_config(load_preset(model)), []
    for seq_len in (1024, 1025, 1026):
        start = clock()
        estimate(spec, TrainingPlan(**fields, seq_len=seq_len))
        out.append((clock() - start) * 1e3)
    return out


def first_trace_s() -> float:
    """The first LoRA estimate of an architecture whose tables are traced (`llmem.derive`; a bare OPT config, 12
    layers at full size, FSDP2 ZeRO-3 bf16-mixed on 8 GPUs), into an empty disk cache, torch, transformers and PEFT
    already imported: seconds."""
    import os
    import tempfile

    import peft  # noqa: F401 - imported before the clock starts
    import transformers  # noqa: F401

    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec

    with tempfile.TemporaryDirectory() as cache:
        os.environ["LLMEM_CACHE_DIR"] = cache
        start = clock()
        estimate(ModelSpec.from_config({"model_type": "opt"}), TrainingPlan(method="lora", gpus=8, zero=3))
        return clock() - start


def main() -> None:
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clock", choices=CLOCKS, default="wall")
    ap.add_argument("--first", action="store_true", help="only the first estimates of a layout and a first trace")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.first:  # (the layouts before torch is imported: its objects make the garbage collector's passes long)
        for name, fields in FIRST.items():
            for m in args.models.split(","):
                print(f"{name}, {m}: first, second, third estimate " +
                      ", ".join(f"{t:.1f}" for t in first_ms(m, fields)) + " ms", flush=True)
        first_trace_s()  # warm: the imports and the trace's first-call costs (a new disk cache each time)
        print(f"first LoRA trace (bare opt, FSDP2 bf16-mixed): {first_trace_s():.2f} s")
        return
    models = args.models.split(",")
    specs = {m: ModelSpec.from_config(load_preset(m)) for m in models}
    print("| plan | " + " | ".join(models) + " |\n|---|" + "---:|" * len(models))
    for name, fields in PLANS.items():
        cells = [median_ms(specs[m], fields, args.rounds) for m in models]
        print(f"| {name} | " + " | ".join("—" if c is None else f"{c:.3f}" for c in cells) + " |", flush=True)
    print(f"\ncompare, 1–64 GPUs (first round, then the median of {args.rounds // 20} more): "
          f"{compare_ms(1):.1f} ms, {compare_ms(max(1, args.rounds // 20)):.1f} ms")


if __name__ == "__main__":
    main()
