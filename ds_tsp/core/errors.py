"""One exception type for bad user input, so callers can catch configuration mistakes separately."""
from __future__ import annotations


class TSPConfigError(ValueError):
    """Bad input: the message names the field, the value and the fix."""


class TSPNonFiniteError(FloatingPointError):
    """A NaN/inf loss or gradient, raised on every rank in the same step; names the step and the first parameter."""


def config_error_in(exc: BaseException | None) -> TSPConfigError | None:
    """The TSPConfigError `exc` is or was raised from (a library may wrap it), else None: what a command line or a
    rank's launcher reports as its one line."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TSPConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
