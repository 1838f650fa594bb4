"""One row of the support matrix (`llmem.support.RULES`, and the side modules `support_pp`, `support_float8`,
`support_lora_tp`, `support_activation` whose rows it appends): a plan condition, the option it blames, the one-line
message with its fix, and whether the real program cannot run it (REFUSED) or llmem does not model it yet (GAP)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmem.errors import InputError


@dataclass(frozen=True)
class Rule:
    """One refused combination: `when(plan)` holds for the refused plans (it reads only `fields`, and `scheme`
    when it names gpus, tp and zero); the error names `blame`, says `message` (formatted with the plan as `p`)."""

    fields: tuple[str, ...]
    blame: str
    when: Callable[[object], bool]
    message: str
    kind: str
    example: dict = field(default_factory=dict, compare=False)

    def error(self, plan) -> InputError:
        return InputError(self.blame, self.message.format(p=plan), self.kind)


def _r(fields: str, blame: str, when: Callable[[object], bool], message: str, kind: str, **example) -> Rule:
    return Rule(tuple(fields.split()), blame, when, message, kind, example)
