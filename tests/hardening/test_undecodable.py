"""Undecodable requests: invalid UTF-8 in every string field of
every PlannerService request gives ``INVALID_ARGUMENT`` with one ``ErrorInfo``
(``INVALID_UTF8``, naming the field), before authentication and never logged at ERROR;
on Chat the stream gets that status at once as a reply and goes on. A NUL character
(U+0000) in any string field is refused the same way (``NUL_CHARACTER``) whatever the
store (decision 0158): the stack here runs on SQLite, which would have stored it.

The requests are raw bytes written from the service's descriptors (protobuf's own
serializer refuses to produce them): for every string field reachable from a request
(nested messages, oneofs and maps included), one message holding ``b"\\xff"`` there.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from ballet.planner.v1 import chat_pb2
from google.protobuf import descriptor
from grpc_status import rpc_status

from service.transport.decoding import SERVICE
from tests.hardening.support import Stack, error_info, start_stack

INVALID = b"\xff\xfe not UTF-8"
NUL = b"a NUL \x00 inside"
#: (payload planted in the field, the reason the refusal gives).
BAD = [(INVALID, "INVALID_UTF8"), (NUL, "NUL_CHARACTER")]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def string_paths(
    message: descriptor.Descriptor, prefix: tuple[descriptor.FieldDescriptor, ...] = ()
) -> Iterator[tuple[descriptor.FieldDescriptor, ...]]:
    """Every path to a string field of ``message`` (a message type is not entered twice on
    one path, so recursive types end)."""
    seen = {field.containing_type.full_name for field in prefix}
    for field in message.fields:
        path = (*prefix, field)
        if field.type == descriptor.FieldDescriptor.TYPE_STRING:
            yield path
        elif field.message_type is not None and field.message_type.full_name not in seen:
            yield from string_paths(field.message_type, path)


def encoded(path: tuple[descriptor.FieldDescriptor, ...], payload: bytes = INVALID) -> bytes:
    data = payload
    for field in reversed(path):
        data = _field(field.number, data)
    return data


def dotted(path: tuple[descriptor.FieldDescriptor, ...]) -> str:
    return ".".join(field.name for field in path)


UNARY = [m for m in SERVICE.methods if not m.client_streaming]
CASES = [
    (method.name, path) for method in UNARY for path in string_paths(method.input_type)
]


def test_every_unary_request_has_string_fields_to_try() -> None:
    assert {name for name, _ in CASES} == {m.name for m in UNARY}
    assert len(UNARY) == 9


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path_factory.mktemp("undecodable") / "data")
    try:
        yield started
    finally:
        await started.stop()


@pytest.fixture(scope="module")
async def planner_address(stack: Stack) -> str:
    planner = await stack.planner()
    return planner.app.address


@pytest.mark.parametrize(("payload", "reason"), BAD, ids=[reason for _, reason in BAD])
@pytest.mark.parametrize(("method", "path"), CASES, ids=[f"{m}:{dotted(p)}" for m, p in CASES])
async def test_invalid_utf8_or_nul_in_a_unary_request_is_invalid_argument(
    planner_address: str,
    method: str,
    path: tuple[descriptor.FieldDescriptor, ...],
    payload: bytes,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(planner_address) as channel:
        call = channel.unary_unary(f"/{SERVICE.full_name}/{method}")
        # No authorization header: the refusal comes before authentication.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(encoded(path, payload), timeout=10)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    status = rpc_status.from_call(error)
    assert status is not None and len(status.details) == 1
    info = error_info(status)
    assert (info.reason, info.domain) == (reason, "planner.ballet")
    assert info.metadata["field"] == dotted(path)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_malformed_request_is_invalid_argument_too(planner_address: str) -> None:
    async with grpc.aio.insecure_channel(planner_address) as channel:
        call = channel.unary_unary(f"/{SERVICE.full_name}/GetSession")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(b"\x0a\x50truncated", timeout=10)
    status = rpc_status.from_call(caught.value)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status is not None and error_info(status).reason == "MALFORMED_REQUEST"


@pytest.mark.parametrize(("payload", "reason"), BAD, ids=[reason for _, reason in BAD])
async def test_invalid_utf8_or_nul_on_chat_gets_a_reply_and_the_stream_goes_on(
    stack: Stack,
    planner_address: str,
    payload: bytes,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    chat_paths = list(string_paths(chat_pb2.ChatRequest.DESCRIPTOR))
    assert {dotted(p) for p in chat_paths} >= {
        "request_id",
        "open.session_id",
        "open.project_id",
        "open.title",
        "send_message.text",
        "cancel_turn.turn_id",
    }
    async with grpc.aio.insecure_channel(planner_address) as channel:
        call = channel.stream_stream(
            f"/{SERVICE.full_name}/Chat",
            response_deserializer=chat_pb2.ChatResponse.FromString,
        )(metadata=stack.auth())
        for number, path in enumerate(chat_paths):
            request_id = f"bad-{number}"
            raw = encoded(path, payload)
            if dotted(path) != "request_id":
                raw = _field(1, request_id.encode()) + raw
            await call.write(raw)
            reply = await call.read()
            assert reply.WhichOneof("event") == "error", reply
            assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            info = error_info(reply.error)
            assert (info.reason, info.metadata["field"]) == (reason, dotted(path))
            if dotted(path) != "request_id":
                assert reply.request_id == request_id
        # The stream still reads: a valid open gets its reply.
        await call.write(
            chat_pb2.ChatRequest(
                request_id="good", open=chat_pb2.OpenAction(project_id="demo")
            ).SerializeToString()
        )
        opened = await call.read()
        assert opened.WhichOneof("event") == "session_opened" and opened.request_id == "good"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
