"""One exception type for bad user input, so callers can catch configuration mistakes separately."""


class TSPConfigError(ValueError):
    """Bad input: the message names the field, the value and the fix."""
