"""The one definition of what runs for a plan (docs/DESIGN.md sections 1 and 2).

`prepare()` builds the model directly in its target dtype, wraps it for the scheme and makes the optimizer;
`train_step()` is one iteration. `measure` (real runs) uses exactly these, so a measurement and the thing it
measures cannot drift apart. This package imports torch; the pure core must not import it.
"""

from llmem.runtime.model import build_model, decoder_layers, hf_config
from llmem.runtime.session import Session, prepare, train_step
from llmem.runtime.topology import Topology

__all__ = ["Session", "Topology", "build_model", "decoder_layers", "hf_config", "prepare", "train_step"]
