"""One exception type for bad user input, so callers can catch configuration mistakes separately."""


class TSPConfigError(ValueError):
    """Bad input: the message names the field, the value and the fix."""


class TSPNonFiniteError(FloatingPointError):
    """A NaN/inf loss or gradient, raised on every rank in the same step; names the step and the first parameter."""
