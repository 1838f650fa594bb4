"""Per-rank phase timeline of a multi-rank run (the counting allocator, marks on every rank).

    torchrun --nproc_per_node N -m llmem.measure.rank_timeline CONFIG.json PLAN.json OUT.json

Each rank records, for every phase mark (build, wrap, forward layer i, lm_head + loss, backward layer i, backward
lm_head, optimizer, zero_grad, end), the live bytes at the mark and the highest live total since the previous mark;
rank 0 writes every rank's list to OUT.json. A calibration aid for the multi-rank estimator terms.
"""

from __future__ import annotations

import json
import sys

from llmem.measure.counting import CountingTracker


class PhaseCountingTracker(CountingTracker):
    """CountingTracker that also records (phase, live at its start, peak inside it, live at its end)."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[list] = []
        self._overall = 0
        self._after_reset = False

    def _close(self) -> None:
        cur, pk = self.ext.current(), self.ext.peak()
        if self._after_reset:
            self._overall = max(self._overall, pk)
        if self.phases:
            self.phases[-1][2] = pk
            self.phases[-1][3] = cur
        self.ext.reset_peak()
        return cur

    def mark(self, name: str) -> None:
        cur = self._close()
        self.phases.append([name, cur, cur, cur])

    def reset_peak(self) -> None:
        self._close()
        super().reset_peak()
        self._after_reset = True
        self.phases.append(["-- reset --", self.live_at_reset, self.live_at_reset, self.live_at_reset])

    def __exit__(self, *exc) -> None:
        self._close()
        super().__exit__(*exc)
        self.peak_bytes = self._overall


def install_layer_marks(session, mark) -> None:
    """Forward / backward marks on each decoder layer (found by name, so any wrapper works) and on lm_head."""
    import re

    from llmem.measure.timeline import mark_backward

    model = getattr(session.model, "module", session.model)
    for name, mod in model.named_modules():
        m = re.fullmatch(r"(?:.*\.)?(?:layers|h)\.(\d+)", name)
        if m:
            i = int(m.group(1))
            mod.register_forward_pre_hook(lambda *_, i=i: mark(f"forward layer {i}"))
            mark_backward(mod, mark, f"backward layer {i}")  # (not a full backward hook: `timeline.mark_backward`)
        elif name.endswith("lm_head"):
            mod.register_forward_pre_hook(lambda *_: mark("lm_head + loss"))
            mark_backward(mod, mark, "backward lm_head")


def run(config: dict, plan_dict: dict, steps: int = 2) -> dict:
    from llmem.measure.run import measure_rank
    from llmem.measure.worker import gather, init_distributed
    from llmem.plan import TrainingPlan

    topo = init_distributed("cpu")
    plan = TrainingPlan(**{**plan_dict, "device": "cpu"})
    tracker = PhaseCountingTracker()
    res = measure_rank(config, plan, steps, topo, tracker=tracker, mark_hook=install_layer_marks)
    res["phases"] = tracker.phases
    return gather(res, topo)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        config = json.load(fh)
    with open(argv[1]) as fh:
        plan = json.load(fh)
    out = run(config, plan)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(argv[2], "w") as fh:
            json.dump(out, fh)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
