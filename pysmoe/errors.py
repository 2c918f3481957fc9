"""Exceptions: one class per smoe_status, all under SmoeError; vault problems under VaultError."""


class SmoeError(Exception):
    """An error reported by libsmoe. `code` is the smoe_status, `args[0]` the library's message."""

    code = -9

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(SmoeError, ValueError):
    code = -1


class BadToken(InvalidArgument):
    code = -2


class ContextFull(SmoeError):
    code = -3


class VaultError(SmoeError):
    """A missing, truncated, corrupted or unsupported vault."""

    code = -4


class ReadError(SmoeError, OSError):
    """A blob read failed or came back short."""

    code = -5


class OutOfMemory(SmoeError, MemoryError):
    code = -6


class SessionBroken(SmoeError):
    code = -7


class Unsupported(SmoeError):
    code = -8


class InternalError(SmoeError):
    code = -9


class Busy(SmoeError, RuntimeError):
    """Another call is running on this session (in another thread); nothing was done."""

    code = -10


class Cancelled(SmoeError):
    """Session.cancel() stopped the call; the session's position is where it was before it."""

    code = -11


BY_CODE = {cls.code: cls for cls in (InvalidArgument, BadToken, ContextFull, VaultError, ReadError,
                                     OutOfMemory, SessionBroken, Unsupported, InternalError, Busy, Cancelled)}
