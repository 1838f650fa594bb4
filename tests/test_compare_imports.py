"""A first strategy table of a hand-written family imports neither transformers nor torch (seconds in a fresh
process): whether the model has a TP plan is the family's trait (`Family.tp_plan`) or the generated table
`llmem.tp_plans`, not its transformers configuration class built (docs/notes/2026-11-28-cold-compare.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import sys
from llmem.compare import compare
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec
spec = ModelSpec.from_config({"_name_or_path": sys.argv[1], **load_preset(sys.argv[1])})  # as llmem/cli.py names it
for n in (1, 2, 8):
    [r.to_dict() for r in compare(spec, TrainingPlan(gpus=n), get_gpu("h100-80gb").memory_bytes).rows]
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "bloom-560m"])
def test_a_first_table_imports_no_transformers(preset, tmp_path):
    """mixtral: TP through its configuration class's plan (an MoE, no replay); bloom: no TP plan at all."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMEM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, preset], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
