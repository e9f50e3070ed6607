"""The one error type of the data part."""


class DataError(RuntimeError):
    """Data that cannot be read: the message names the file, the episode and what was expected."""
