"""Where this process sits: rank, world size, device, and the launch it runs under."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_type: str = "cpu"

    @property
    def device(self) -> str:
        return "cpu" if self.device_type == "cpu" else f"{self.device_type}:{self.local_rank}"

    @classmethod
    def from_env(cls, device_type: str) -> Topology:
        """From torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK); a single process when they are absent."""
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            device_type=device_type,
        )


def under_torchrun() -> bool:
    """True inside a torchrun (or SLURM + torchrun) launch: torchrun sets these for every worker."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
