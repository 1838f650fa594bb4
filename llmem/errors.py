"""The one error type the library raises for bad input.

Every front-end (CLI, app) catches `InputError` and shows its message; anything else escaping is a bug.
"""


class InputError(ValueError):
    """Bad user input. `field` names the offending input; the message says what is allowed."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
