"""Errors that reach a user: each one prints as a single line, never a traceback."""


class PdserveError(Exception):
    """Base for errors caused by input or configuration (shown to the user as one line)."""


class ModelLoadError(PdserveError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class InvalidRequestError(PdserveError):
    """A request or its sampling parameters are invalid (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CapacityError(PdserveError):
    """No room for the request right now (HTTP 429): queue or KV capacity is full."""
