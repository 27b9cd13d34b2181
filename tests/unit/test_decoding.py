"""The lenient request deserializer (service.transport.decoding): a request protobuf
refuses becomes an ``Undecodable`` naming the field at fault, never an exception."""

from __future__ import annotations

from ballet.planner.v1 import chat_pb2, planner_service_pb2

from service.transport.decoding import Undecodable, lenient


def field(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_valid_requests_decode_as_usual() -> None:
    request = planner_service_pb2.GetSessionRequest(session_id="s-1")
    decoded = lenient(planner_service_pb2.GetSessionRequest)(request.SerializeToString())
    assert decoded == request


def test_invalid_utf8_names_the_nested_field_and_keeps_a_readable_request_id() -> None:
    raw = field(1, b"req-7") + field(2, field(1, b"\xff\xfe"))  # open.session_id
    decoded = lenient(chat_pb2.ChatRequest)(raw)
    assert isinstance(decoded, Undecodable)
    assert (decoded.field, decoded.request_id) == ("open.session_id", "req-7")
    error = decoded.error()
    assert (error.reason, error.metadata) == ("INVALID_UTF8", {"field": "open.session_id"})


def test_a_request_id_that_is_itself_invalid_is_not_echoed() -> None:
    decoded = lenient(chat_pb2.ChatRequest)(field(1, b"\xc3("))
    assert isinstance(decoded, Undecodable)
    assert (decoded.field, decoded.request_id) == ("request_id", "")


def test_malformed_bytes_are_a_malformed_request() -> None:
    for raw in (b"\x0a\x50short", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b"):
        decoded = lenient(planner_service_pb2.GetSessionRequest)(raw)
        assert isinstance(decoded, Undecodable), raw
        assert decoded.field == ""
        assert decoded.error().reason == "MALFORMED_REQUEST"


def test_nul_in_a_nested_string_is_refused_naming_the_field() -> None:
    raw = field(1, b"req-8") + field(3, field(1, b"hello \x00 world"))  # send_message.text
    decoded = lenient(chat_pb2.ChatRequest)(raw)
    assert isinstance(decoded, Undecodable)
    assert (decoded.field, decoded.request_id) == ("send_message.text", "req-8")
    error = decoded.error()
    assert (error.reason, error.metadata) == ("NUL_CHARACTER", {"field": "send_message.text"})


def test_zero_bytes_of_the_encoding_itself_are_not_nul_characters() -> None:
    # An empty nested message and a zero-length field encode as a 0x00 byte.
    request = chat_pb2.ChatRequest(request_id="r", open=chat_pb2.OpenAction())
    data = request.SerializeToString()
    assert b"\x00" in data
    assert lenient(chat_pb2.ChatRequest)(data) == request
