"""The one translation of backend RPC failures (docs/contributing.md), pinned as tables.

``tool_failure``: what the model sees for a failed tool call (docs/spec/turn-loop.md step 5).
``get_project``/``read_skill``: which domain error ends session creation or a turn
(docs/spec/authority.md and docs/spec/turn-loop.md). No I/O: the errors are built as grpc.aio raises
them.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped, unused-ignore]

from ballet_common.grpc.status import parse
from service.adapters.backends import project_error, skill_error, tool_failure
from service.core.errors import NotFound, PlannerError, Unauthenticated, Unavailable

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, message: str, reason: str = "") -> grpc.aio.AioRpcError:
    """An ``AioRpcError`` carrying a ``google.rpc.Status`` with one ``ErrorInfo``."""
    trailing = grpc.aio.Metadata()
    if reason:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="tracker.ballet"))
        status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
        trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, message)


@pytest.mark.parametrize(
    ("code", "reason", "expected", "keeps_message"),
    [
        (Code.PERMISSION_DENIED, "MISSING_PERMISSION", "PERMISSION_DENIED", True),
        (Code.NOT_FOUND, "ITEM_NOT_FOUND", "NOT_FOUND", True),
        (Code.ABORTED, "STALE_VERSION", "STALE_VERSION", True),
        (Code.ABORTED, "", "STALE_VERSION", True),
        (Code.ABORTED, "CONCURRENT_CHANGE", "CONFLICT", True),
        (Code.ALREADY_EXISTS, "", "CONFLICT", True),
        (Code.INVALID_ARGUMENT, "BAD_REF", "INVALID_ARGUMENTS", True),
        (Code.FAILED_PRECONDITION, "ITEM_CLOSED", "INVALID_ARGUMENTS", True),
        (Code.OUT_OF_RANGE, "", "INVALID_ARGUMENTS", True),
        (Code.UNAVAILABLE, "", "BACKEND_UNAVAILABLE", False),
        (Code.DEADLINE_EXCEEDED, "", "DEADLINE_EXCEEDED", False),
        (Code.UNAUTHENTICATED, "TOKEN_EXPIRED", "CREDENTIAL_EXPIRED", False),
        (Code.UNAUTHENTICATED, "WRONG_AUDIENCE", "BACKEND_ERROR", False),
        (Code.INTERNAL, "", "BACKEND_ERROR", False),
        (Code.UNKNOWN, "", "BACKEND_ERROR", False),
        (Code.RESOURCE_EXHAUSTED, "", "BACKEND_ERROR", False),
        (Code.CANCELLED, "", "BACKEND_ERROR", False),
    ],
)
def test_tool_failures(
    code: grpc.StatusCode, reason: str, expected: str, keeps_message: bool
) -> None:
    failure = tool_failure(parse(rpc_error(code, "the backend's words", reason)))
    assert failure.reason == expected
    assert failure.message
    # Refusals the model can act on keep the backend's explanation; internal failures do
    # not pass backend internals on to the model.
    assert (failure.message == "the backend's words") is keeps_message


@pytest.mark.parametrize(
    ("code", "reason", "kind", "expected_reason"),
    [
        (Code.NOT_FOUND, "", NotFound, "PROJECT_NOT_FOUND"),
        (Code.PERMISSION_DENIED, "", NotFound, "PROJECT_NOT_FOUND"),
        (Code.UNAVAILABLE, "", Unavailable, "DEPENDENCY_UNAVAILABLE"),
        (Code.DEADLINE_EXCEEDED, "", Unavailable, "DEPENDENCY_UNAVAILABLE"),
        (Code.INTERNAL, "", Unavailable, "DEPENDENCY_UNAVAILABLE"),
        (Code.UNAUTHENTICATED, "TOKEN_EXPIRED", Unauthenticated, "TOKEN_EXPIRED"),
        (Code.UNAUTHENTICATED, "", Unauthenticated, "UNAUTHENTICATED"),
    ],
)
def test_get_project_errors(
    code: grpc.StatusCode, reason: str, kind: type[PlannerError], expected_reason: str
) -> None:
    error = project_error(parse(rpc_error(code, "x", reason)), "demo")
    assert type(error) is kind
    assert error.reason == expected_reason


@pytest.mark.parametrize(
    ("code", "kind", "expected_reason"),
    [
        (Code.NOT_FOUND, NotFound, "SKILL_NOT_FOUND"),
        (Code.PERMISSION_DENIED, NotFound, "SKILL_NOT_FOUND"),
        (Code.UNAVAILABLE, Unavailable, "DEPENDENCY_UNAVAILABLE"),
        (Code.UNAUTHENTICATED, Unauthenticated, "UNAUTHENTICATED"),
    ],
)
def test_read_skill_errors(
    code: grpc.StatusCode, kind: type[PlannerError], expected_reason: str
) -> None:
    error = skill_error(parse(rpc_error(code, "x")), "planning")
    assert type(error) is kind
    assert error.reason == expected_reason
