"""One module per memory component; each is a pure function of (ModelSpec, TrainingPlan) returning int bytes."""

from enum import Enum


class Category(str, Enum):
    """The breakdown's categories, in the order they are shown."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer states"
    ACTIVATIONS = "activations"
    LOGITS = "logits/loss"
    COMMUNICATION = "communication buffers"
    TEMPORARIES = "temporaries"

    def __str__(self) -> str:
        return self.value
