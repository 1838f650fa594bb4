"""The walk of one steady-state iteration (DESIGN.md section 1) as a sequence of named moments, where live memory
can peak: `single` for one device, DDP, ZeRO-1 and TP; `fsdp` for FSDP2 (ZeRO-2/3, TP x FSDP2); `accumulation` for
the micro-steps of `--grad-accum`. Each moment is a `phase.Phase`: a breakdown by category that sums to its total.
`llmem.estimate` takes the largest."""
