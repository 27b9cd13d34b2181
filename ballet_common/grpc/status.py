"""The gRPC rich error model, built and read in one place (AIP-193).

Every Ballet service ends a failed call with a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer: the code, the message, exactly one
``google.rpc.ErrorInfo`` (a domain such as ``planner.ballet`` and a stable UPPER_SNAKE
reason, with metadata) and, when the caller should wait before retrying, one
``google.rpc.RetryInfo``. ``RpcFailure`` is that status as a value:

- servers build one and send it (``RpcFailure.to_grpc_status`` for
  ``context.abort_with_status``; ``RpcFailure.to_status`` for a status carried in a
  message, such as the Chat stream's ``error`` event);
- clients read one from a failed call (``parse``) or from a message (``from_status``);
  a server's interceptor reads what its handler sent (``from_trailers``).

Reading goes through ``grpc_status.rpc_status`` (the gRPC project's own parser of the
trailer). A peer is not trusted to be well-formed: details that do not decode, or whose
code contradicts the call's own, are ignored and the failure keeps the call's code and
message with no reason, never an exception; details whose message differs from the call's
are kept (the call's message is the failure's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = ["RpcFailure", "code_name", "from_status", "from_trailers", "parse"]


@dataclass(frozen=True)
class RpcFailure:
    """A failed call: its code and message, the ``ErrorInfo``'s reason, domain and
    metadata (empty when the peer sent none) and the ``RetryInfo`` delay in seconds
    (None: no ``RetryInfo``)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    domain: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None

    def to_status(self) -> status_pb2.Status:
        """The ``google.rpc.Status``: one ``ErrorInfo``, then a ``RetryInfo`` if any."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        status.details.add().Pack(
            error_details_pb2.ErrorInfo(
                reason=self.reason, domain=self.domain, metadata=dict(self.metadata)
            )
        )
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return status

    def to_grpc_status(self) -> grpc.Status:
        """The status to end a call with (``context.abort_with_status``): code, message
        and the packed ``google.rpc.Status`` in the trailer."""
        status: grpc.Status = rpc_status.to_status(self.to_status())
        return status


def parse(error: grpc.RpcError) -> RpcFailure:
    """What a failed call (``grpc.aio.AioRpcError`` or a sync ``grpc.RpcError`` that is
    also a ``grpc.Call``) says: its code and message, and the reason, domain, metadata
    and retry delay of its rich status when it has a well-formed one."""
    call: Any = error
    code = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (call.details() if callable(getattr(call, "details", None)) else "") or ""
    try:
        status = rpc_status.from_call(call)
    except DecodeError:
        status = None
    except ValueError:
        # grpc_status refuses a rich status that contradicts the status line. A message
        # that differs is common (servers that word them apart, proxies that rewrite
        # grpc-message) and the details still hold; a code that differs is not trusted.
        status = _same_code_status(call, code)
    if status is None:
        return RpcFailure(code, message)
    return _with_details(RpcFailure(code, message), status)


def from_status(status: status_pb2.Status) -> RpcFailure:
    """The failure a ``google.rpc.Status`` carried in a message says (e.g. the Chat
    stream's ``error`` event)."""
    return _with_details(RpcFailure(_code_of(status.code), status.message), status)


def from_trailers(metadata: Any) -> RpcFailure | None:
    """The failure packed in trailing metadata (pairs of key and value), e.g. what a
    server's handler aborted with as its interceptor sees it (``context.trailing_metadata
    ()``); None without a decodable rich status."""
    for key, value in metadata or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            try:
                return from_status(status_pb2.Status.FromString(value))
            except DecodeError:
                return None
    return None


def code_name(code: int) -> str:
    """The name of a numeric gRPC code (``5`` -> ``NOT_FOUND``); unknown ones as digits."""
    return _code_of(code).name if code in _CODES else str(code)


_CODES = {member.value[0]: member for member in grpc.StatusCode}
#: The trailer of the packed ``google.rpc.Status`` (gRPC's rich error model).
DETAILS_KEY = "grpc-status-details-bin"


def _same_code_status(call: Any, code: grpc.StatusCode) -> status_pb2.Status | None:
    for key, value in call.trailing_metadata() or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)  # decoded by from_call already
            return status if status.code == code.value[0] else None
    return None


def _code_of(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def _with_details(failure: RpcFailure, status: status_pb2.Status) -> RpcFailure:
    reason, domain, metadata, retry_after_s = "", "", {}, None
    seen_info = False
    for detail in status.details:
        if not seen_info and detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
                seen_info = True
        elif retry_after_s is None and detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            if detail.Unpack(retry):
                retry_after_s = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    return RpcFailure(failure.code, failure.message, reason, domain, metadata, retry_after_s)
