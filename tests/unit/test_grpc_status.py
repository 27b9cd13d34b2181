"""The rich error model in one place (``ballet_common.grpc.status``): what a server sends
is what a client reads, and a hostile peer's trailer never hides the call's own status.
No I/O: the errors are built as grpc.aio raises them."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from ballet_common.grpc.status import RpcFailure, code_name, from_status, from_trailers, parse

Code = grpc.StatusCode
DETAILS_KEY = "grpc-status-details-bin"


def rpc_error(code: grpc.StatusCode, message: str, trailer: bytes | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata() if trailer is None else grpc.aio.Metadata((DETAILS_KEY, trailer))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, message)


def test_what_a_server_sends_a_client_reads() -> None:
    sent = RpcFailure(
        Code.RESOURCE_EXHAUSTED,
        "slow down",
        "RATE_LIMITED",
        "llm.ballet",
        {"limit": "4"},
        retry_after_s=2.5,
    )
    status = sent.to_grpc_status()
    ((key, packed),) = status.trailing_metadata
    assert key == DETAILS_KEY and (status.code, status.details) == (sent.code, sent.message)
    assert parse(rpc_error(status.code, status.details, packed)) == sent
    assert from_status(sent.to_status()) == sent


def test_exactly_one_error_info_then_the_retry_info() -> None:
    status = RpcFailure(Code.UNAVAILABLE, "down", "X", "d", retry_after_s=1).to_status()
    names = [d.TypeName() for d in status.details]
    assert names == ["google.rpc.ErrorInfo", "google.rpc.RetryInfo"]
    assert len(RpcFailure(Code.NOT_FOUND, "gone", "Y", "d").to_status().details) == 1


@pytest.mark.parametrize(
    "trailer",
    [
        b"\xff\x00garbage",  # does not decode
        status_pb2.Status(code=Code.INTERNAL.value[0], message="gone").SerializeToString(),
    ],
    ids=["undecodable", "contradicts-the-code"],
)
def test_a_trailer_that_cannot_be_trusted_keeps_the_calls_own_status(trailer: bytes) -> None:
    assert parse(rpc_error(Code.NOT_FOUND, "gone", trailer)) == RpcFailure(Code.NOT_FOUND, "gone")


def test_details_worded_apart_from_the_status_line_still_count() -> None:
    sent = RpcFailure(Code.ABORTED, "the entry changed", "STALE_VERSION", "knowledge.ballet")
    error = rpc_error(Code.ABORTED, "raced", sent.to_status().SerializeToString())
    assert parse(error) == RpcFailure(Code.ABORTED, "raced", "STALE_VERSION", "knowledge.ballet")


def test_a_call_without_details_has_no_reason() -> None:
    assert parse(rpc_error(Code.UNAVAILABLE, "", None)) == RpcFailure(Code.UNAVAILABLE, "")


def test_the_first_error_info_counts_and_other_details_are_skipped() -> None:
    status = status_pb2.Status(code=Code.ABORTED.value[0], message="m")
    for detail in (
        error_details_pb2.DebugInfo(detail="x"),
        error_details_pb2.ErrorInfo(reason="FIRST", domain="a"),
        error_details_pb2.ErrorInfo(reason="SECOND", domain="b"),
    ):
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    failure = from_status(status)
    assert (failure.code, failure.reason, failure.domain) == (Code.ABORTED, "FIRST", "a")


def test_code_names() -> None:
    assert code_name(5) == "NOT_FOUND" and code_name(99) == "99"
    assert from_status(status_pb2.Status(code=99)).code == Code.UNKNOWN


def test_a_servers_interceptor_reads_what_its_handler_sent() -> None:
    sent = RpcFailure(Code.NOT_FOUND, "gone", "SESSION_NOT_FOUND", "planner.ballet")
    assert from_trailers(sent.to_grpc_status().trailing_metadata) == sent
    assert from_trailers(((DETAILS_KEY, b"\xff\x00"),)) is None
    assert from_trailers(()) is None
