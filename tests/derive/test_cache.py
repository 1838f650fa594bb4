"""The derived tables and inventory are cached on disk: a second estimate of the same config, in a fresh process,
imports neither torch nor transformers and gives the same bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.derive.configs import config

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import json, sys
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import modelled_spec
est = estimate(modelled_spec(json.load(open(sys.argv[1]))), TrainingPlan(batch_size=2, seq_len=48, attn="eager"))
print(json.dumps([est.peak_bytes, [m for m in ("torch", "transformers") if m in sys.modules]]))
"""


def test_a_repeated_estimate_reads_the_cache_without_torch(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config("granite")))
    env = {**os.environ, "LLMEM_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        out = subprocess.run([sys.executable, "-c", CODE, str(path)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    (first, heavy_first), (again, heavy_again) = run(), run()
    assert "torch" in heavy_first and heavy_again == [] and again == first > 0
