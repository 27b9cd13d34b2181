"""The one table from domain errors to gRPC statuses (AIP-193), pinned."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from ballet_common.grpc.status import from_status
from ballet_common.tokens import TokenError
from service.core import errors
from service.transport.errors import (
    abort,
    failure_of,
    rpc_errors,
    status_of,
)

Code = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (
            errors.InvalidArgument("x", reason="INVALID_PAGE_SIZE"),
            Code.INVALID_ARGUMENT,
            "INVALID_PAGE_SIZE",
        ),
        (errors.InvalidArgument("x"), Code.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (errors.NotFound("x", reason="SESSION_NOT_FOUND"), Code.NOT_FOUND, "SESSION_NOT_FOUND"),
        (
            errors.FailedPrecondition("x", reason="TURN_IN_PROGRESS"),
            Code.FAILED_PRECONDITION,
            "TURN_IN_PROGRESS",
        ),
        (errors.OutOfRange("x"), Code.OUT_OF_RANGE, "OUT_OF_RANGE"),
        (
            errors.ResourceExhausted("x", reason="TOO_MANY_TURNS"),
            Code.RESOURCE_EXHAUSTED,
            "TOO_MANY_TURNS",
        ),
        (
            errors.Unauthenticated("x", reason="TOKEN_EXPIRED"),
            Code.UNAUTHENTICATED,
            "TOKEN_EXPIRED",
        ),
        (
            errors.PermissionDenied("x", reason="HUMAN_REQUIRED"),
            Code.PERMISSION_DENIED,
            "HUMAN_REQUIRED",
        ),
        (
            errors.Unavailable("x", reason="DEPENDENCY_UNAVAILABLE"),
            Code.UNAVAILABLE,
            "DEPENDENCY_UNAVAILABLE",
        ),
        (errors.HumanRequired("x"), Code.PERMISSION_DENIED, "HUMAN_REQUIRED"),
        (errors.Internal("x"), Code.INTERNAL, "INTERNAL"),
        (errors.PlannerError("x"), Code.INTERNAL, "INTERNAL"),
        (errors.StoreUnavailable("connection refused"), Code.UNAVAILABLE, "DATABASE_UNAVAILABLE"),
        # A conflict is the core's to resolve; one that reaches the transport is a bug.
        (errors.StoreConflict("changed"), Code.INTERNAL, "INTERNAL"),
        (TokenError("WRONG_AUDIENCE", "x"), Code.UNAUTHENTICATED, "WRONG_AUDIENCE"),
        (RuntimeError("secret detail"), Code.INTERNAL, "INTERNAL"),
        (KeyError("k"), Code.INTERNAL, "INTERNAL"),
    ],
)
def test_status_table(error: Exception, code: grpc.StatusCode, reason: str) -> None:
    status = status_of(error)
    assert status.code == code.value[0]
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = from_status(status)
    assert info is not None
    assert (info.domain, info.reason) == ("planner.ballet", reason)


def test_subclasses_map_like_their_parent() -> None:
    class SessionGone(errors.NotFound):
        default_reason = "SESSION_GONE"

    assert failure_of(SessionGone("x")).code == Code.NOT_FOUND


def test_unexpected_errors_leak_no_text() -> None:
    status = status_of(RuntimeError("password=hunter2"))
    assert "hunter2" not in str(status)
    assert status.message == "internal error"


def test_metadata_and_retry_info() -> None:
    error = errors.ResourceExhausted(
        "too many", reason="TOO_MANY_TURNS", retry_after_s=2.5, metadata={"limit": "4"}
    )
    status = status_of(error)
    info = from_status(status)
    assert info is not None and dict(info.metadata) == {"limit": "4"}
    retry = error_details_pb2.RetryInfo()
    assert status.details[1].Unpack(retry)
    assert retry.retry_delay.ToNanoseconds() == 2_500_000_000
    assert len(status_of(errors.NotFound("x")).details) == 1
    database = status_of(errors.StoreUnavailable("down"))
    assert database.details[1].Is(error_details_pb2.RetryInfo.DESCRIPTOR)


class RecordingContext:
    """Records what a servicer aborts with, like a grpc.aio context would."""

    def __init__(self) -> None:
        self.aborted: grpc.Status | None = None

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.aborted = status
        raise grpc.aio.AbortError()


async def test_abort_sends_the_status_in_the_trailers() -> None:
    context = RecordingContext()
    with pytest.raises(grpc.aio.AbortError):
        await abort(context, errors.NotFound("gone", reason="SESSION_NOT_FOUND"))
    assert context.aborted is not None
    sent = context.aborted
    assert (sent.code, sent.details) == (Code.NOT_FOUND, "gone")
    ((key, packed),) = sent.trailing_metadata
    status = status_pb2.Status.FromString(packed)
    assert key == "grpc-status-details-bin" and status.code == Code.NOT_FOUND.value[0]
    assert from_status(status).reason == "SESSION_NOT_FOUND"


async def test_rpc_errors_maps_exceptions_and_never_swallows_cancellation() -> None:
    context = RecordingContext()
    with pytest.raises(grpc.aio.AbortError):
        async with rpc_errors(context):
            raise errors.InvalidArgument("bad", reason="INVALID_PAGE_TOKEN")
    assert context.aborted is not None and context.aborted.code == Code.INVALID_ARGUMENT

    quiet = RecordingContext()
    with pytest.raises(asyncio.CancelledError):
        async with rpc_errors(quiet):
            raise asyncio.CancelledError()
    with pytest.raises(grpc.aio.AbortError):
        async with rpc_errors(quiet):
            raise grpc.aio.AbortError()
    assert quiet.aborted is None


@pytest.mark.parametrize("char", ["x", "\u00e9", "\U0001f3ad"])
def test_whatever_raised_it_an_error_on_the_wire_is_bounded(char: str) -> None:
    # A 1 MiB identifier quoted by some error must not break the metadata limit.
    # Found by the property test: 1,000 emoji in an update_mask path made a 12 KiB
    # percent-encoded grpc-message, which the client reported as RESOURCE_EXHAUSTED.
    huge = char * (1024 * 1024)
    error = errors.NotFound(
        f"thing {huge} not found",
        reason="THING_NOT_FOUND",
        metadata={f"k{n}{huge}": huge for n in range(100)},
    )
    status = status_of(error)
    percent_encoded = sum(1 if ch.isascii() else 3 * len(ch.encode()) for ch in status.message)
    assert percent_encoded + len(status.SerializeToString()) * 4 / 3 < 6 * 1024
    info = from_status(status)
    assert info is not None and info.reason == "THING_NOT_FOUND"
    assert status.message.endswith("...")
    assert errors.echo(huge) == huge[:61] + "..."
    assert errors.echo("short") == "short"
