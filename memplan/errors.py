"""memplan's errors, each carrying the exit code the CLI maps it to.

0 ok · 1 bad input or unsupported model · 2 does not fit · 3 verify error above tolerance.
"""


class MemplanError(Exception):
    """Base class: a one-line message for the user, and an exit code."""

    exit_code = 1


class BadInput(MemplanError):
    """The user's input (model spec, option, file) cannot be used."""

    exit_code = 1


class DoesNotFit(MemplanError):
    """The training step does not fit the memory available."""

    exit_code = 2


class ToleranceExceeded(MemplanError):
    """A measured peak differs from the prediction by more than the tolerance."""

    exit_code = 3
