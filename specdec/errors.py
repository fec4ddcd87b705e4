"""The one exception type users see: a clear, one-line message."""


class SpecdecError(Exception):
    """A user-facing error (bad input, missing file, unsupported model...)."""
