"""The library calls the app makes, cached per process with `st.cache_resource` (imported by app.py only).

A spec is cached per model name (or upload digest); estimates, comparisons and make-it-fit answers per spec key and
plan key, so a redraw recomputes only what an input change touched. An InputError is never cached: a retry retries.
"""

from __future__ import annotations

import gc
import os
import socket

import streamlit as st

from llmem import share
from llmem.errors import InputError
from llmem.plan import TrainingPlan

PRESET_LABEL = {"yes": "", "derived": " (traced from transformers on first use)", "not yet": " (not modelled yet)"}
TRACING = "Estimating… an architecture outside the hand-written families is traced from transformers on first use"


@st.cache_resource(show_spinner=False)
def presets() -> list:
    from llmem.presets import list_presets

    return list_presets()


@st.cache_resource(show_spinner=False)
def preset_labels() -> dict[str, str]:
    """Each preset's label in the selector: name — Hugging Face id, and whether it is traced or not modelled yet
    (working that out imports transformers once; the labels never change)."""
    return {p.name: f"{p.name} — {p.hf_id}{PRESET_LABEL[p.estimator]}" for p in presets()}


@st.cache_resource(show_spinner=False)
def settle_heap() -> bool:
    """Once per process, after its first page: a full collection, then every object alive moved to the permanent
    generation (`gc.freeze`), so that later full collections scan only what the app has made since. The presets'
    labels import transformers and torch (some 200,000 objects): a full collection over them paused one redraw for
    0.6 s."""
    gc.collect()
    gc.freeze()
    return True


HUB, HUB_PROBE_SECONDS = ("huggingface.co", 443), 3.0


def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers a TCP connection within `HUB_PROBE_SECONDS`. Offline, the hub client
    retries five times with backoff (about 30 s) before it gives up; the probe answers in seconds."""
    try:
        with socket.create_connection(HUB, timeout=HUB_PROBE_SECONDS):
            return True
    except OSError:
        return False


def cached_config_path(repo_id: str) -> str | None:
    """The config.json of `repo_id` in this server's Hugging Face cache, if a fetch put one there."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, "config.json")
    return path if isinstance(path, str) else None


def _offline_source(model: str):
    """(config, origin) for a Hugging Face id when the hub cannot be reached: this server's cached copy, or an
    InputError saying what to do instead. None when the hub answers (or the id names a preset, or HF_HUB_OFFLINE
    already makes the hub client read the cache only)."""
    from llmem.presets import find_preset
    from llmem.sources import config_from_bytes

    offline_env = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline_env or find_preset(model) is not None or "/" not in model or hub_reachable():
        return None
    path = cached_config_path(model.partition("@")[0])
    if path is None:
        raise InputError("model", f"offline: the Hugging Face hub cannot be reached and {model} is not in this "
                         "server's cache; pick a preset or upload its config.json")
    with open(path, "rb") as f:  # the hub cache's own file for a checked org/name id, never a path a user gave
        data = f.read(1 << 20)
    parsed = config_from_bytes(data, "config.json")
    return getattr(parsed, "config", parsed), f"Hugging Face cache (hub unreachable): {model}"


@st.cache_resource(show_spinner="Loading the model's config.json (a Hugging Face id is fetched from the hub)…",
                   max_entries=64)
def spec_for_model(model: str):
    """(ModelSpec, origin) for a preset name or Hugging Face id (the spinner shows while a fetch takes long)."""
    from llmem.sources import resolve_model
    from llmem.spec import modelled_spec

    share.check_model_name(model)  # never let the app open a server path, whatever the caller passed
    offline = _offline_source(model)
    if offline is not None:
        return modelled_spec(offline[0]), offline[1]
    source = resolve_model(model)
    return modelled_spec(source.config), source.origin


@st.cache_resource(show_spinner=False, max_entries=16)
def spec_for_upload(digest: str, _data: bytes, name: str):
    from llmem.sources import config_from_bytes
    from llmem.spec import modelled_spec

    parsed = config_from_bytes(_data, name)
    config = getattr(parsed, "config", parsed)  # ModelSource or plain dict
    return modelled_spec(config), f"uploaded {name}"


@st.cache_resource(show_spinner=False, max_entries=32)
def config_for_model(model: str) -> dict:
    from llmem.sources import resolve_model

    share.check_model_name(model)
    return resolve_model(model).config


def plan_key(plan: TrainingPlan) -> str:
    """A cheap cache key for a plan (hashing a short string beats hashing a tuple of pairs)."""
    return repr(sorted(plan.to_dict().items()))


@st.cache_resource(show_spinner=False, max_entries=2048)
def estimate(spec_key: str, key: str, _spec, _plan: TrainingPlan):
    from llmem.estimate import estimate as run

    return run(_spec, _plan)


@st.cache_resource(show_spinner=TRACING, max_entries=256)  # shown after 0.5 s: a first trace, not a cache miss
def compare(spec_key: str, key: str, capacity: int, methods: str, _spec, _plan: TrainingPlan):
    from llmem.compare import compare as run
    from llmem.compare import method_variants

    return run(_spec, _plan, capacity, variants=method_variants(methods))


@st.cache_resource(show_spinner="Looking for changes that fit…", max_entries=256)
def make_fit(spec_key: str, key: str, gpu_key: str, any_strategy: bool, _spec, _plan: TrainingPlan):
    """(fixes, fewest GPUs of this type or None) for a plan that does not fit."""
    from llmem.gpus import get_gpu
    from llmem.makefit import make_fit as run
    from llmem.makefit import min_gpus

    gpu = get_gpu(gpu_key)
    return run(_spec, _plan, gpu, any_strategy=any_strategy), min_gpus(_spec, _plan, gpu.memory_bytes)


@st.cache_resource(show_spinner=False, max_entries=64)
def fit_grid(spec_key: str, key: str, _spec, _plan: TrainingPlan):
    from llmem.makefit import fit_grid as run

    return run(_spec, _plan)
