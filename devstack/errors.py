"""The devstack backends' error family: one exception type per gRPC code, each with a reason.

Raised by the store and the servicers alike and turned into a ``google.rpc.Status`` with
exactly one ``ErrorInfo`` in one place (``devstack.rpc``), following AIP-193 as
docs/spec/api-and-streams.md asks of every Ballet service. ``reason`` is a stable UPPER_SNAKE value
that tests and the planner match on; ``metadata`` carries the ids that explain it (string values
only, as ``ErrorInfo.metadata`` requires).

This module imports neither grpc nor SQLAlchemy, so the store can raise these errors
without knowing about the transport: ``code`` is the *name* of a ``grpc.StatusCode``.
"""

from __future__ import annotations

from collections.abc import Mapping


class BackendError(Exception):
    """A refused backend call: a gRPC status code name, a reason and a message."""

    #: The name of the ``grpc.StatusCode`` member, e.g. ``NOT_FOUND``.
    code = "UNKNOWN"

    def __init__(self, reason: str, message: str, metadata: Mapping[str, str] | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})


class Unauthenticated(BackendError):
    """No valid bearer token for this backend's audience (docs/spec/authority.md)."""

    code = "UNAUTHENTICATED"


class PermissionDenied(BackendError):
    """The human may see the resource but lacks the permission the RPC needs."""

    code = "PERMISSION_DENIED"


class NotFound(BackendError):
    """The resource does not exist, or the human may not know that it exists."""

    code = "NOT_FOUND"


class InvalidArgument(BackendError):
    """The request is malformed: a bad field, page size or page token."""

    code = "INVALID_ARGUMENT"


class Aborted(BackendError):
    """A concurrency conflict, e.g. an update sent with a stale version."""

    code = "ABORTED"


class FailedPrecondition(BackendError):
    """The request is valid but the system is not in a state that allows it."""

    code = "FAILED_PRECONDITION"


class Internal(BackendError):
    """A bug or an unexpected failure inside the backend."""

    code = "INTERNAL"


class Injected(BackendError):
    """An error the fault injector was told to produce; ``code`` is set per instance."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.code = code
