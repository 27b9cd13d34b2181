"""Requests that cannot be decoded: a clear ``INVALID_ARGUMENT``, never ``UNKNOWN``.

gRPC's Python server decodes a request with the method's ``request_deserializer`` before
any handler runs; protobuf refuses a ``string`` field that is not UTF-8 (proto3), and an
exception there ends the call ``UNKNOWN`` with no ``ErrorInfo``, logged at ERROR before
anyone is authenticated. ``add_planner_service`` therefore registers
PlannerService with a deserializer that never raises: a message protobuf refuses becomes
an ``Undecodable`` value, which

- a unary method answers at once with ``INVALID_ARGUMENT`` and one ``ErrorInfo``
  (``INVALID_UTF8`` naming the field, or ``MALFORMED_REQUEST``), before authentication,
  logged at INFO without content;
- the Chat reader receives in place of a ``ChatRequest`` and answers with an ``error``
  reply; the stream goes on (the framing is intact, only that message is refused).

A string field holding NUL (U+0000) is refused the same way (``NUL_CHARACTER`` naming
the field): PostgreSQL's ``text`` cannot hold it, and refusing it here, for every store,
means a client that works against ``dev`` on SQLite works against production too
(docs/decisions/0158-nul-characters-refused-on-the-wire.md). The check costs one ``in``
over the request's bytes; the fields are walked only when a zero byte is there.

The handlers are built from the service's descriptor (method names, message types,
streaming), the same table the generated ``add_PlannerServiceServicer_to_server`` writes
by hand, so a new RPC is covered without a change here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
from ballet.planner.v1 import planner_service_pb2
from google.protobuf import descriptor, message, message_factory

from service.core.errors import InvalidArgument
from service.transport.errors import abort

log = logging.getLogger(__name__)

SERVICE = planner_service_pb2.DESCRIPTOR.services_by_name["PlannerService"]
#: Nesting followed when looking for the field at fault (protobuf's own limit is 100).
_MAX_DEPTH = 100


class Undecodable:
    """A request refused before its handler: its type, and the field at fault when one
    was found.

    ``field`` is the dotted path of the first string field that is not UTF-8 (e.g.
    ``open.session_id``), or, with ``nul``, of the first one holding U+0000; empty when
    the bytes are malformed otherwise. ``request_id`` is the message's top-level
    ``request_id`` when it is readable, so a Chat reply can echo it.
    """

    def __init__(
        self, message_type: descriptor.Descriptor, data: bytes, *, nul_field: str = ""
    ) -> None:
        self.message_type = message_type
        self.nul = bool(nul_field)
        self.field = nul_field or _first_invalid_string(message_type, data, "", 0) or ""
        self.request_id = _top_level_string(message_type, data, "request_id")

    def error(self) -> InvalidArgument:
        """The refusal: ``NUL_CHARACTER`` or ``INVALID_UTF8`` with the field in the
        ErrorInfo metadata, or ``MALFORMED_REQUEST``."""
        if self.nul:
            return InvalidArgument(
                f"field {self.field} of the request holds a NUL (U+0000) character",
                reason="NUL_CHARACTER",
                metadata={"field": self.field},
            )
        if self.field:
            return InvalidArgument(
                f"field {self.field} of the request is not valid UTF-8",
                reason="INVALID_UTF8",
                metadata={"field": self.field},
            )
        return InvalidArgument(
            f"the request is not a valid {self.message_type.name}", reason="MALFORMED_REQUEST"
        )


def lenient(cls: type[message.Message]) -> Callable[[bytes], Any]:
    """A request deserializer for ``cls`` that returns ``Undecodable`` instead of raising
    (or instead of a request with NUL in a string field)."""
    message_type = cast(descriptor.Descriptor, cls.DESCRIPTOR)

    def deserialize(data: bytes) -> Any:
        try:
            request = cls.FromString(data)
        except message.DecodeError:
            return Undecodable(message_type, data)
        if b"\x00" in data:
            field = _first_string_with_nul(message_type, data, "", 0)
            if field:
                return Undecodable(message_type, data, nul_field=field)
        return request

    return deserialize


def add_planner_service(servicer: Any, server: Any) -> None:
    """Register ``servicer``'s PlannerService methods on a ``grpc.aio`` server with
    lenient request deserializers (see the module docstring)."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        options: dict[str, Any] = {
            "request_deserializer": lenient(request_cls),
            "response_serializer": response_cls.SerializeToString,
        }
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, **options)
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _refusing_undecodable(method.full_name, behaviour), **options
            )
        else:  # pragma: no cover - PlannerService has no such method
            raise TypeError(f"{method.full_name}: unsupported streaming shape")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _refusing_undecodable(
    name: str, behaviour: Callable[[Any, Any], Awaitable[Any]]
) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            log.info(
                "refused an undecodable request: method=%s field=%s",
                name,
                request.field or "-",
            )
            await abort(context, request.error())
        return await behaviour(request, context)

    return handle


# --------------------------------------------------------------------------- the wire

# Wire types (protobuf encoding): varint, 64-bit, length-delimited, 32-bit. Groups (3, 4)
# are not proto3 and end the walk.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, bytes]]:
    """``(field number, wire type, payload)`` of each length-delimited field of ``data``
    (other fields skipped); stops at the first malformed byte."""
    found: list[tuple[int, int, bytes]] = []
    offset = 0
    try:
        while offset < len(data):
            tag, offset = _varint(data, offset)
            number, wire = tag >> 3, tag & 7
            if wire == _VARINT:
                _, offset = _varint(data, offset)
            elif wire == _I64:
                offset += 8
            elif wire == _I32:
                offset += 4
            elif wire == _LEN:
                size, offset = _varint(data, offset)
                if offset + size > len(data):
                    break
                found.append((number, wire, data[offset : offset + size]))
                offset += size
            else:
                break
    except ValueError:
        pass
    return found


def _not_utf8(payload: bytes) -> bool:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _holds_nul(payload: bytes) -> bool:
    return b"\x00" in payload


def _first_invalid_string(
    message_type: descriptor.Descriptor, data: bytes, prefix: str, depth: int
) -> str | None:
    """The dotted path of the first ``string`` field of ``data`` (decoded as
    ``message_type``, nested messages included) that is not UTF-8, or None."""
    return _first_string(message_type, data, _not_utf8, prefix, depth)


def _first_string_with_nul(
    message_type: descriptor.Descriptor, data: bytes, prefix: str, depth: int
) -> str | None:
    """The dotted path of the first ``string`` field of ``data`` (nested messages
    included) that holds U+0000, or None."""
    return _first_string(message_type, data, _holds_nul, prefix, depth)


def _first_string(
    message_type: descriptor.Descriptor,
    data: bytes,
    bad: Callable[[bytes], bool],
    prefix: str,
    depth: int,
) -> str | None:
    """The dotted path of the first ``string`` field of ``data`` (decoded as
    ``message_type``) whose bytes are ``bad``, nested messages included, or None."""
    if depth > _MAX_DEPTH:
        return None
    for number, _, payload in _fields(data):
        field = message_type.fields_by_number.get(number)
        if field is None:
            continue
        path = f"{prefix}{field.name}"
        if field.type == descriptor.FieldDescriptor.TYPE_STRING:
            if bad(payload):
                return path
        elif field.message_type is not None:
            found = _first_string(field.message_type, payload, bad, f"{path}.", depth + 1)
            if found:
                return found
    return None


def _top_level_string(message_type: descriptor.Descriptor, data: bytes, name: str) -> str:
    field = message_type.fields_by_name.get(name)
    if field is None or field.type != descriptor.FieldDescriptor.TYPE_STRING:
        return ""
    value = ""
    for number, _, payload in _fields(data):
        if number == field.number:
            try:
                value = payload.decode("utf-8")  # the last occurrence wins, as in protobuf
            except UnicodeDecodeError:
                value = ""
    return value
