"""Real runs: the CPU allocation tracker, CUDA statistics, torchrun launching, validation grids.

Imports torch (through llmem.runtime); the pure estimator never imports this package.
"""
