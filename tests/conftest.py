import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from hypothesis import settings  # noqa: E402

# Repeatable property tests: the same examples on every run and machine (CI must not turn red by chance).
settings.register_profile("llmem", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("llmem")
