"""Fake-tensor runs of the real runtime: per-op allocation timeline, peak, caching-allocator model.

Imports torch (through llmem.runtime); the pure estimator never imports this package.
"""

from llmem.simulate.result import LiveTensor, Phase, Simulation
from llmem.simulate.run import simulate

__all__ = ["LiveTensor", "Phase", "Simulation", "simulate"]
