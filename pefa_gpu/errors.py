"""Exceptions raised by pefa_gpu. Every one says what was wrong and with what."""


class PefaError(Exception):
    """Base class of the library's own errors."""


class InputError(PefaError, ValueError):
    """An argument has the wrong shape, range or content."""


class MissingDependencyError(PefaError, ImportError):
    """An optional dependency is needed for this call; the message says what to install."""


class FormatError(PefaError, ValueError):
    """A saved file or directory is corrupt, foreign, or from an unsupported version."""
