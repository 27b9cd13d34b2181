"""Domain errors, each with a stable UPPER_SNAKE ``reason`` (AIP-193).

Three families (after Pydantic AI's split):

- ``PlannerError`` and its subclasses: a request the planner refuses or cannot serve.
  ``service/transport/errors.py`` maps each class to one gRPC code with one ``ErrorInfo``
  (domain ``planner.ballet``); nothing else chooses status codes.
- ``ToolFailure``: a tool call that failed; it becomes an error result for the model and
  the conversation goes on (docs/spec/authority.md, "A failing tool call ...").
- ``ModelFailure``: a model call that failed after the gateway's retries; it ends the turn
  ``FAILED`` with its reason (docs/spec/turn-loop.md, Deadlines).

The store raises ``StoreUnavailable`` (a ``PlannerError``: ``DATABASE_UNAVAILABLE``, the
same status wherever it surfaces) and ``StoreConflict`` (a conditional write lost; the
caller decides what that means).
"""

from __future__ import annotations

ERROR_DOMAIN = "planner.ballet"
#: Most characters of a client's identifier an error quotes (message and ErrorInfo
#: metadata): a huge id must give a small error, not one that breaks the metadata limit.
ECHO_MAX_CHARS = 64


def echo(identifier: str) -> str:
    """``identifier`` as an error may quote it: at most ``ECHO_MAX_CHARS`` characters,
    a cut one ending in ``...``."""
    if len(identifier) <= ECHO_MAX_CHARS:
        return identifier
    return identifier[: ECHO_MAX_CHARS - 3] + "..."


class PlannerError(Exception):
    """A refused or failed request. ``reason`` is stable; ``message`` is for humans.

    ``retry_after_s`` (seconds), when set, becomes a ``google.rpc.RetryInfo``;
    ``metadata`` goes into the ``ErrorInfo``.
    """

    default_reason = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        retry_after_s: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.retry_after_s = retry_after_s
        self.metadata = metadata or {}


class InvalidArgument(PlannerError):
    """Bad input: a missing or malformed field, a bad page token, a reused request id."""

    default_reason = "INVALID_ARGUMENT"


class NotFound(PlannerError):
    """An unknown session or turn, or one the caller may not see (existence never leaks)."""

    default_reason = "NOT_FOUND"


class FailedPrecondition(PlannerError):
    """The request does not fit the current state, e.g. ``TURN_IN_PROGRESS``."""

    default_reason = "FAILED_PRECONDITION"


class OutOfRange(PlannerError):
    """A sequence beyond the last one."""

    default_reason = "OUT_OF_RANGE"


class ResourceExhausted(PlannerError):
    """A limit was reached: ``TOO_MANY_TURNS``, ``TOO_MANY_STREAMS``, ``SLOW_CONSUMER``."""

    default_reason = "RESOURCE_EXHAUSTED"


class Unauthenticated(PlannerError):
    """A missing, bad or expired bearer token."""

    default_reason = "UNAUTHENTICATED"


class PermissionDenied(PlannerError):
    """An authenticated caller without the right to do this."""

    default_reason = "PERMISSION_DENIED"


class HumanRequired(PermissionDenied):
    """A service principal asked for what only the session's human may do (chat, send,
    cancel, change or delete): service principals may only read."""

    default_reason = "HUMAN_REQUIRED"


class Unavailable(PlannerError):
    """The database or a dependency cannot be reached; the caller may retry."""

    default_reason = "UNAVAILABLE"


class Internal(PlannerError):
    """A bug or an invariant that does not hold."""

    default_reason = "INTERNAL"


class ToolFailure(Exception):
    """A tool call failed; the model gets ``{"error": {"reason", "message"}}``.

    Reasons: ``INVALID_ARGUMENTS``, ``UNKNOWN_TOOL``, ``PERMISSION_DENIED``,
    ``NOT_FOUND``, ``STALE_VERSION``, ``CONFLICT``, ``BACKEND_UNAVAILABLE``,
    ``DEADLINE_EXCEEDED``, ``WRITE_LIMIT_REACHED``, ``POLICY_CHANGE_NOT_ALLOWED``,
    ``CREDENTIAL_EXPIRED``, ``TOO_MANY_CALLS``, ``CANCELLED``, ``INTERRUPTED``,
    ``BACKEND_ERROR``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class ModelFailure(Exception):
    """A model call failed for good; the turn ends FAILED with ``reason``.

    Reasons: ``MODEL_UNAVAILABLE``, ``QUOTA_EXCEEDED``, ``CREDENTIAL_EXPIRED``,
    ``MODEL_TIMEOUT``, ``MODEL_ERROR``. ``retryable`` marks ``UNAVAILABLE`` and
    ``RATE_LIMITED`` refusals (docs/spec/turn-loop.md, Retries), with ``retry_after_s`` from a
    ``RetryInfo`` when the gateway sent one.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retryable: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class StoreConflict(Exception):
    """A conditional store write found the state changed (e.g. the turn already ended)."""


class StoreUnavailable(Unavailable):
    """The database cannot be reached or failed mid-transaction. Nothing was stored,
    except when the connection broke during the commit itself: then the write may have
    landed with its reply lost, and a caller that must know reads it back (decision 0372).

    Every caller sees the same status: ``UNAVAILABLE``/``DATABASE_UNAVAILABLE`` with a
    fixed message and a retry after 1 s (the database is usually back quickly). What
    went wrong (the driver's first line) is ``detail`` and ``str(error)``, for logs and
    operators, never sent to a client."""

    default_reason = "DATABASE_UNAVAILABLE"
    #: The message clients get, whatever the cause.
    CLIENT_MESSAGE = "the database is unavailable; retry later"
    RETRY_AFTER_S = 1.0

    def __init__(self, detail: str = "") -> None:
        super().__init__(self.CLIENT_MESSAGE, retry_after_s=self.RETRY_AFTER_S)
        self.detail = detail or self.CLIENT_MESSAGE

    def __str__(self) -> str:
        return self.detail
