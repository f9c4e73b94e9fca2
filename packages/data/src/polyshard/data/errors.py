"""The one error of polyshard.data."""


class DataError(ValueError):
    """Data that cannot be read, prepared or split as asked; the message names the file (and line) and the fix."""
