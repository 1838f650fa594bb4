"""The one error type the library raises for bad input.

Every front-end (CLI, app) catches `InputError` and shows its message; anything else escaping is a bug.
"""

INPUT, REFUSED, GAP = "input", "refused", "gap"
KINDS = (INPUT, REFUSED, GAP)


class InputError(ValueError):
    """Bad user input. `field` names the offending input; the message says what is allowed.

    `kind` says why: "input" (a value that is malformed or out of range), "refused" (a right refusal: the real
    program cannot run this, e.g. an optimizer without a fused kernel), or "gap" (it could run, but llmem does not
    model it yet). The support matrix (`llmem.support`) sets it for the plan's rules; reports count the gaps."""

    def __init__(self, field: str, message: str, kind: str = INPUT):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.field, self.kind = field, kind
        super().__init__(f"{field}: {message}")

    @property
    def gap(self) -> bool:
        """Whether this is something llmem does not model yet (not a plan the real program refuses)."""
        return self.kind == GAP
