"""User-facing errors.

A :class:`VerispecError` is a mistake the user can fix (a bad flag, a missing package, a corrupt
file). The CLI prints its message on one line and exits non-zero, without a traceback; the server
turns it into an OpenAI-style 400 error. Anything else is a bug and keeps its traceback.
"""


class VerispecError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""


class ModelNotInstalledError(VerispecError):
    """A bundled model's weight packages are not installed."""


class ChecksumError(VerispecError):
    """A model file does not have the expected sha256 (truncated or corrupt download)."""


class QueueFullError(VerispecError):
    """The engine's queue is full; the server answers 429 with ``Retry-After: retry_after``."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ConfigError(VerispecError):
    """A setting's value is refused.

    ``field`` is the setting's public name (``verispec.load``'s keyword, see :data:`verispec.config.NAMES`)
    so that each front end can say it its own way: the CLI names the flag, the server answers with the
    request field as OpenAI's ``param``. The message is ``"<field> <problem>"``; :meth:`named` puts
    another name in front of the same problem.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem

    def named(self, name: str) -> str:
        """The message with the setting called ``name`` (``--top-p``, ``speculation.top_k``)."""
        return f"{name} {self.problem}"

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # picklable despite two arguments
        return (type(self), (self.field, self.problem))
