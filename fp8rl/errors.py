"""Domain errors shared by the services. Each maps to exactly one gRPC status code, in one table
(:data:`fp8rl.serving.STATUS_OF`), so handlers raise plain exceptions and never touch gRPC."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input; the message starts with the offending field's name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class PreconditionFailed(RuntimeError):
    """The request is well formed but the server's state does not allow it (wrong version, wrong step,
    a replica that needs a keyframe). The message says what the server holds or expects."""


class NotReady(RuntimeError):
    """The server cannot take the request yet (engine loading, shutting down); retrying is safe."""


class Overloaded(RuntimeError):
    """The server is at a configured capacity (queued samples, concurrent calls); retry later.
    ``transient``: the same call may be served once others finish (false for a request that is over a
    per-request cap, which asking again never changes)."""

    def __init__(self, message: str, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


class Cancelled(RuntimeError):
    """The caller went away; the work it asked for was abandoned."""


class Unauthenticated(PermissionError):
    """The caller did not prove who it is (no or unknown token, no certificate, an update whose signature
    does not verify)."""


class PermissionDenied(PermissionError):
    """The caller is known but its role may not do this (or the target is not the run's)."""


class WeightCodecError(ValueError):
    """A weight update that cannot be applied."""


class BaseMismatchError(WeightCodecError):
    """A delta computed against a version (or bytes) other than those the receiver holds."""


class CorruptUpdateError(WeightCodecError):
    """Truncated, reordered or corrupted bytes: a size, parse or digest check failed."""
