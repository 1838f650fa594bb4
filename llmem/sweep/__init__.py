"""Random-plan sweeps: estimate vs an oracle (`llmem.measure` on CPU, or `llmem.simulate`) over plans drawn at random
from every option the estimator accepts.

`draw`, `models`, `stats` and `report` are pure and import no torch; `run` calls the oracle at the edge.
"""
