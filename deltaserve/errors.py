"""Errors that cross module boundaries.

Every message names the thing at fault, the expected and the found value, and (where one exists) the
flag or request field that changes it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A model config, checkpoint or engine flag that cannot be served. Raised before serving starts."""


class RequestValidationError(ValueError):
    """A request field with an invalid value. `field` is the request field's wire name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class UnsupportedRequestError(RequestValidationError):
    """A request asks for a feature this engine refuses rather than silently degrading."""


class EngineStoppedError(RuntimeError):
    """Work submitted to an engine that has shut down (its scheduler no longer runs): raised at once, where
    it would otherwise wait for outputs that never come."""
