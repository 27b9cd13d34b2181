"""The one table from domain errors to gRPC status codes (AIP-193; docs/contributing.md).

Every refusal leaves the planner as a ``google.rpc.Status`` with exactly one
``google.rpc.ErrorInfo`` (domain ``planner.ballet``, the error's stable reason, its
metadata) and, when the error sets ``retry_after_s``, a ``google.rpc.RetryInfo``. Unary
calls carry it in their trailers (``abort``); the Chat stream sends it as its ``error``
event (``status_of``). The status itself is built by ``ballet_common.grpc.status``.

Nothing else in the service chooses a status code. An exception that is not a domain
error is a bug: it becomes ``INTERNAL`` with reason ``INTERNAL`` and a fixed message, so
no text of it leaks; it is logged with its traceback. ``asyncio.CancelledError`` and
``grpc.aio.AbortError`` are never caught here (they derive from ``BaseException`` or are
re-raised as they are).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.rpc import status_pb2

from ballet_common.grpc.status import RpcFailure
from ballet_common.tokens import TokenError
from service.core import errors

log = logging.getLogger(__name__)

#: The servicer context of a planner call (grpc.aio), whatever its message types (the
#: class is generic only in its type stubs).
if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = grpc.aio.ServicerContext

INTERNAL_MESSAGE = "internal error"
#: Bounds on what an error carries (UTF-8 bytes), whatever raised it: quoted identifiers
#: are cut where they are quoted (``service.core.errors.echo``); these keep any other
#: path from a reply over gRPC's metadata limit (8 KiB by default, which the client then
#: reports as RESOURCE_EXHAUSTED): the message travels twice (``grpc-message``,
#: percent-encoded, up to 3 bytes per byte; and in ``grpc-status-details-bin``, base64),
#: so message and metadata together stay under about 5 KiB on the wire.
MESSAGE_MAX_BYTES = 512
METADATA_KEY_MAX_BYTES = 64
METADATA_VALUE_MAX_BYTES = 128
METADATA_MAX_ENTRIES = 8

#: Domain error class -> gRPC code. Resolved along the class's MRO, so a subclass maps
#: like its nearest listed ancestor. Pinned by tests/unit/test_transport_errors.py.
STATUS_CODES: Mapping[type[BaseException], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Internal: grpc.StatusCode.INTERNAL,
    errors.PlannerError: grpc.StatusCode.INTERNAL,
    TokenError: grpc.StatusCode.UNAUTHENTICATED,
}


def _code_for(error: BaseException) -> grpc.StatusCode | None:
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return None


def failure_of(error: Exception) -> RpcFailure:
    """Map an exception to its ``RpcFailure`` using ``STATUS_CODES``.

    ``PlannerError`` (``StoreUnavailable`` included): its reason, message, metadata,
    ``retry_after_s``. ``TokenError``: UNAUTHENTICATED with its reason. Anything else is
    a bug: INTERNAL/INTERNAL with a fixed message (logged here).
    """
    if isinstance(error, errors.PlannerError):
        code = _code_for(error) or grpc.StatusCode.INTERNAL
        if isinstance(error, errors.Internal) or type(error) is errors.PlannerError:
            log.error("internal error: %s", error.reason, exc_info=error)
        metadata = {
            _cut(key, METADATA_KEY_MAX_BYTES): _cut(value, METADATA_VALUE_MAX_BYTES)
            for key, value in list(error.metadata.items())[:METADATA_MAX_ENTRIES]
        }
        return RpcFailure(
            code,
            _cut(error.message, MESSAGE_MAX_BYTES),
            error.reason,
            errors.ERROR_DOMAIN,
            metadata,
            error.retry_after_s,
        )
    if isinstance(error, TokenError):
        return RpcFailure(
            grpc.StatusCode.UNAUTHENTICATED,
            _cut(error.message, MESSAGE_MAX_BYTES),
            error.reason,
            errors.ERROR_DOMAIN,
        )
    log.error("unexpected error", exc_info=error)
    return RpcFailure(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, "INTERNAL", errors.ERROR_DOMAIN)


def _cut(text: str, max_bytes: int) -> str:
    """``text`` in at most ``max_bytes`` bytes of UTF-8, a cut one ending in ``...``."""
    encoded = text.encode()
    if len(encoded) <= max_bytes:
        return text
    return encoded[: max_bytes - 3].decode(errors="ignore") + "..."


def status_of(error: Exception) -> status_pb2.Status:
    """The ``google.rpc.Status`` of ``error``, e.g. for the Chat ``error`` event."""
    return failure_of(error).to_status()


async def abort(context: Context, error: Exception) -> NoReturn:
    """End a call with ``error`` mapped by ``failure_of``; raises ``grpc.aio.AbortError``.

    The code and message go in
    the status line; the packed ``google.rpc.Status`` in ``grpc-status-details-bin``.
    """
    await context.abort_with_status(failure_of(error).to_grpc_status())
    raise AssertionError("context.abort_with_status returned")  # pragma: no cover


class rpc_errors:  # lower case: used like a function, ``async with rpc_errors(ctx):``
    """``async with rpc_errors(context):`` around a servicer method's body.

    A domain error (or any other ``Exception``) raised inside ends the call through
    ``abort``. ``asyncio.CancelledError`` (a ``BaseException``) and ``grpc.aio.AbortError``
    pass through untouched.
    """

    def __init__(self, context: Context) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        if isinstance(exc, grpc.aio.AbortError):
            return
        await abort(self._context, exc)
