"""Mappings several formats share: the HF Trainer's optimizer names, bf16/fp16 flags, FSDP settings (accelerate's
`fsdp_config`, the Trainer's, axolotl's), the base model and LoRA target lists."""

from __future__ import annotations

from llmem.importers.core import AUTO, Reader

# HF `OptimizerNames` (transformers.training_args) -> (optimizer, implementation, note)
OPTIM = {
    "adamw_torch": ("adamw", "default", ""),
    "adamw_torch_fused": ("adamw", "fused", ""),
    "adamw_hf": ("adamw", "forloop", "transformers' own AdamW (removed in v5): a for-loop step"),
    "adamw_bnb_8bit": ("adamw8bit", "default", ""),
    "adamw_8bit": ("adamw8bit", "default", ""),
    "paged_adamw_8bit": ("paged-adamw8bit", "default", ""),
    "adafactor": ("adafactor", "default", "transformers' Adafactor: the same factored states as torch's, which "
                  "llmem models"),
    "sgd": ("sgd", "default", "the Trainer's SGD has momentum 0 unless optim_args sets it: llmem's sgd keeps a "
            "momentum buffer, one parameter-sized state more"),
}
OPTIM_MISSING = {
    "paged_adamw_32bit": "bitsandbytes' paged 32-bit AdamW", "adamw_bnb_32bit": "bitsandbytes' 32-bit AdamW",
    "adamw_torch_8bit": "torchao's 8-bit AdamW", "adamw_torch_4bit": "torchao's 4-bit AdamW",
    "adamw_apex_fused": "apex's fused AdamW", "adamw_anyprecision": "torchdistx's AnyPrecisionAdamW",
}


UPPER = "llmem's estimate is an upper bound"
NOT_MODELLED = {
    "torch_compile": "torch.compile fuses kernels and changes what is saved: not modelled",
    "compile": "torch.compile fuses kernels and changes what is saved: not modelled",
    "auto_find_batch_size": "the Trainer halves the batch after an out-of-memory error: the estimate is of the "
                            "batch the file gives",
    "activation_offloading": f"saved activations move to host memory: not modelled, {UPPER}",
    "enable_activation_offloading": f"saved activations move to host memory: not modelled, {UPPER}",
    "padding_free": f"sequences are concatenated without padding: not modelled, {UPPER}",
    "optimizer_in_bwd": f"each gradient is applied and freed during backward: not modelled, {UPPER}",
    "use_unsloth": "Unsloth's kernels and offloaded checkpointing are not modelled",
    "use_dora": "DoRA's magnitude vectors and their activations are not modelled; estimated as LoRA",
}


def not_modelled(r: Reader, keys: tuple[str, ...]) -> None:
    """An ignored line, with why, for each of `keys` the file turns on."""
    for key in keys:
        if r.get(key) not in (None, False):
            r.ignore(key, NOT_MODELLED.get(key, "not modelled"))


def optim(r: Reader, path: str, name: str | None) -> None:
    """An HF Trainer optimizer name (`optim`, axolotl's `optimizer`) -> --optimizer and --optimizer-impl."""
    if name is None:
        return
    key = name.strip().lower()
    if key in OPTIM:
        opt, impl, note = OPTIM[key]
        r.set(path, "optimizer", opt, note)
        r.set(path, "optimizer_impl", impl, "")
        return
    what = OPTIM_MISSING.get(key, "this optimizer")
    r.ignore(path, f"{what} is not modelled; llmem has adamw (adamw_torch, adamw_torch_fused), sgd, adafactor, "
             "adamw8bit (adamw_bnb_8bit) and paged-adamw8bit (paged_adamw_8bit): pass --optimizer")


def precision(r: Reader, bf16: str, fp16: str, pure: bool, how: str, neither: str = "") -> None:
    """bf16/fp16 flags -> --precision: `pure` when the weights themselves are loaded in that dtype (`how` says
    why), else autocast over fp32 weights (bf16-mixed / fp16-mixed). With both off (or absent), `neither` is fp32's
    reason when the format then trains in fp32; else an ignored line says the script's loading decides."""
    b, f = r.flag(bf16), r.flag(fp16)
    for path, value, half in ((bf16, b, "bf16"), (fp16, f, "fp16")):
        if value is True:
            r.set(path, "precision", half if pure else f"{half}-mixed", how)
            return
    for path, value in ((bf16, b), (fp16, f)):
        if value == AUTO:
            r.ignore(path, "'auto' is settled by the hardware at launch (bf16 where supported); precision keeps "
                     "llmem's default unless another file sets it")
            return
    if neither:
        r.set(bf16, "precision", "fp32", neither, shown=b)
    elif b is False and f is False:
        r.ignore(bf16, "neither bf16 nor fp16: no autocast, the weights train in the dtype the script loads them in "
                 "(pass --precision fp32, or bf16 for a model loaded in bfloat16)")


FSDP1_STRATEGY = {"FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0}


def fsdp(r: Reader, cfg: str, version_default: int, version_key: str = "") -> str:
    """An FSDP section at `cfg` (keys with or without accelerate's "fsdp_" prefix): version 2 is the program llmem
    estimates (reshard_after_forward -> --zero 3 or 2, offload_params -> --offload optimizer+params); version 1 is
    another engine, mapped to its nearest FSDP2 plan only with --engine torch. Returns the version read."""
    s = r.get(cfg, {})
    if isinstance(s, str):
        r.ignore(cfg, "a path; llmem never opens files a config names")
        s = {}
    elif not isinstance(s, dict):
        r.section(cfg)  # the one-line error naming the key
    prefix = "fsdp_" if any(str(k).startswith("fsdp_") for k in s) else ""
    key = lambda name: f"{cfg}.{prefix}{name}"  # noqa: E731
    vkey = version_key or key("version")
    version = r.text(vkey) or str(version_default)
    if version not in ("1", "2"):
        r.ignore(vkey, "FSDP versions are 1 and 2")
        return version
    fsdp1 = "FSDP1 (FullyShardedDataParallel)"
    if version == "2":
        k = key("reshard_after_forward")
        reshard = r.flag(k)
        r.set(k, "zero", 2 if reshard is False else 3, "FSDP2 fully_shard" + (
            "" if r.has(k) else f" ({vkey} = {version}; reshard_after_forward defaults to true)"), shown=reshard)
    else:
        _fsdp1(r, key, vkey, version)
    if r.flag(key("offload_params")) is True:
        if version == "2":
            r.set(key("offload_params"), "offload", "optimizer+params", "FSDP2 CPUOffloadPolicy")
        else:
            r.engine(key("offload_params"), "offload", "optimizer+params", fsdp1, "--offload optimizer+params")
    if r.flag(key("activation_checkpointing")) is True:
        r.set(key("activation_checkpointing"), "grad_ckpt", "full", "every decoder layer: the wrapped layer class")
    return version


FSDP1_NAMES = {0: "NO_SHARD", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
FSDP1_MODELLED = {"use_orig_params": True, "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False}


def _fsdp1(r: Reader, key, vkey: str, version: str) -> None:  # noqa: ANN001
    """FSDP1: FULL_SHARD / SHARD_GRAD_OP / NO_SHARD are `--engine fsdp1 --zero 3 / 2 / 0` (llmem's FSDP1 program,
    with accelerate's `use_orig_params`, BACKWARD_PRE, no forward prefetch: other values are reported, not
    modelled); with --engine torch, the nearest PyTorch program as before."""
    fsdp1 = "FSDP1 (FullyShardedDataParallel)"
    k = key("sharding_strategy") if r.has(key("sharding_strategy")) else key("reshard_after_forward")
    strategy = str(r.get(k) or "FULL_SHARD").strip().upper()
    if strategy not in FSDP1_STRATEGY:
        r.ignore(k, f"FSDP1 {strategy} is not modelled (hybrid sharding shards within a node only)", strategy)
        return
    zero = FSDP1_STRATEGY[strategy]
    if r.engine_torch:
        r.engine(k, "zero", zero, fsdp1, f"--zero {zero}")
        return
    r.set(k, "zero", zero, f"FSDP1 {FSDP1_NAMES[zero]}", shown=strategy)
    if r.has(vkey):
        r.set(vkey, "engine", "fsdp1", f"{fsdp1}, as accelerate wraps it")
    else:
        r.set(k, "engine", "fsdp1", f"{fsdp1}, as accelerate wraps it (FSDP version {version})", shown=strategy)
    for name, modelled in FSDP1_MODELLED.items():
        value = r.flag(key(name)) if isinstance(modelled, bool) else r.text(key(name))
        if value is not None and str(value).upper() != str(modelled).upper():
            r.ignore(key(name), f"llmem's FSDP1 program runs {name} = {modelled}; other values are not modelled")


def model(r: Reader, path: str) -> None:
    """A base model name -> --model when it is a preset (by name or Hugging Face id); anything else is reported:
    llmem never downloads or opens what a file names."""
    name = r.text(path)
    if not name:
        return
    from llmem.presets import find_preset

    info = find_preset(name)
    if info is not None:
        r.set(path, "model", info.name, f"the preset of {info.hf_id}")
    else:
        r.ignore(path, "not a preset name or a preset's Hugging Face id; llmem does not download or open what a file "
                 "names: pass --model (a preset, a config.json path or a Hugging Face id)")


def targets(r: Reader, path: str, value: object, why: str = "") -> None:
    """PEFT target modules (a list, "all-linear", or a comma-separated string) -> --lora-targets."""
    if value is None:
        return
    if isinstance(value, str) and any(ch in value for ch in "*()[]|\\^$?+"):
        r.ignore(path, "a regular expression over module names; llmem takes names: pass --lora-targets", value)
        return
    r.set(path, "lora_targets", value, why, shown=value)
