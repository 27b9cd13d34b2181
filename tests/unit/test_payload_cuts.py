"""The cuts that keep large payloads within their bounds: tool-call arguments over their
bound (decision 0221), messages sent to a client (0222), and model requests over the
gateway's limit (0224). Each cut stays valid JSON where the field is JSON, says how
large the whole was, and leaves what fits untouched."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from service.adapters.request_fit import FLOOR_BYTES, content_bytes, fit
from service.core.client_copy import (
    MESSAGE_OVERHEAD_BYTES,
    delta_for_client,
    message_for_client,
    messages_for_client,
)
from service.core.model import Message, MessageKind, TextDelta
from service.core.ports import ModelMessage, Role, ToolCall
from service.core.tools.cut import cut_text, utf8_size

NOW = datetime(2026, 1, 1, tzinfo=UTC)
KiB = 1024
MiB = 1024 * KiB


@pytest.mark.parametrize(
    "text",
    [
        '{"item_id":"' + "x" * 100_000 + '"}',
        '{"body": "' + "é€😀" * 20_000 + '"',  # not JSON at all: cut off mid-string
        '"\\u0000\\n\\t' * 10_000,  # escapes everywhere
        "\x00\x01\x02" * 20_000,  # control characters: six bytes each as JSON
    ],
    ids=["ascii", "multibyte-invalid-json", "escapes", "control-characters"],
)
def test_cut_text_is_valid_json_within_the_bound_with_the_full_size(text: str) -> None:
    cut = cut_text(text, 16 * KiB)
    assert len(cut.encode()) <= 16 * KiB
    value = json.loads(cut)
    assert value["truncated"] is True
    assert value["original_bytes"] == len(text.encode())
    assert text.startswith(value["content"]) and len(value["content"]) > 0
    # Nearly all of the bound is used: a cut keeps as much as fits.
    assert len(cut.encode()) > 16 * KiB - 64


def test_utf8_size_tells_only_what_is_over_the_limit() -> None:
    assert utf8_size("x" * 100, 400) is None  # short enough without encoding
    assert utf8_size("é" * 300, 400) == 600
    assert utf8_size("é" * 150, 400) is None


def message(**fields: object) -> Message:
    values: dict[str, object] = {
        "session_id": "s1",
        "turn_id": "t1",
        "message_id": "m1",
        "kind": MessageKind.ASSISTANT,
        "create_time": NOW,
        "sequence": 7,
    }
    values.update(fields)
    return Message(**values)  # type: ignore[arg-type]


def test_a_message_that_fits_is_sent_as_it_is() -> None:
    small = message(text="hello")
    assert message_for_client(small, 64 * KiB) is small


def test_a_long_answer_is_sent_as_its_start_marked_truncated() -> None:
    stored = message(text="word " * (MiB // 5), cut=False)
    sent = message_for_client(stored, 256 * KiB)
    assert sent.truncated and sent.original_bytes == len(stored.text.encode())
    assert stored.text.startswith(sent.text)
    assert sent.size_bytes() + MESSAGE_OVERHEAD_BYTES <= 256 * KiB
    assert not sent.cut  # the answer itself is whole
    assert (sent.sequence, sent.message_id) == (stored.sequence, stored.message_id)
    assert not stored.truncated


def test_long_arguments_are_sent_as_valid_json() -> None:
    arguments = json.dumps({"title": "t", "body": "é" * MiB})
    stored = message(
        kind=MessageKind.TOOL_CALL, tool_name="create_knowledge", tool_arguments=arguments
    )
    sent = message_for_client(stored, 256 * KiB)
    assert sent.truncated and sent.original_bytes == len(arguments.encode())
    cut = json.loads(sent.tool_arguments)
    assert cut["truncated"] and arguments.startswith(cut["content"])
    assert sent.size_bytes() + MESSAGE_OVERHEAD_BYTES <= 256 * KiB


def test_the_messages_of_one_response_share_the_bound_and_small_ones_stay_whole() -> None:
    small = [message(message_id=f"s{i}", text="ok") for i in range(5)]
    large = [message(message_id=f"l{i}", text="x" * MiB) for i in range(4)]
    sent = messages_for_client([*small, *large], 2 * MiB)
    assert sent[:5] == small
    assert all(m.truncated for m in sent[5:])
    assert sum(m.size_bytes() + MESSAGE_OVERHEAD_BYTES for m in sent) <= 2 * MiB


def test_a_long_delta_keeps_its_end_at_its_offset() -> None:
    delta = TextDelta("s1", "t1", "m1", 10, "a" * (200 * KiB) + "end")
    sent = delta_for_client(delta, 64 * KiB)
    assert sent.text.endswith("end") and len(sent.text) <= 64 * KiB
    assert sent.offset + len(sent.text) == delta.offset + len(delta.text)
    assert delta_for_client(TextDelta("s1", "t1", "m1", 0, "short"), 64 * KiB).text == "short"


def encoded(messages: list[ModelMessage]) -> int:
    """A stand-in for the request's encoding: 2 KiB of system prompt and tools, plus
    each message's content and a few bytes of its own."""
    return 2 * KiB + sum(content_bytes(m) + 16 for m in messages)


def test_a_request_over_its_limit_is_cut_largest_first_and_the_newest_last() -> None:
    messages = [
        ModelMessage(Role.USER, "first question"),
        ModelMessage(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "get_item", "{" + "a" * MiB),)),
        ModelMessage(Role.TOOL, json.dumps({"items": ["b" * 500] * 100}), tool_call_id="c1"),
        ModelMessage(Role.ASSISTANT, "c" * (2 * MiB)),
        ModelMessage(Role.USER, "d" * (200 * KiB)),
    ]
    fitted = fit(messages, MiB, encoded)
    assert fitted is not None
    result, count = fitted
    assert encoded(result) <= MiB
    assert result[0] is messages[0]  # small ones are not touched
    assert result[-1] is messages[-1]  # the newest is cut last, and needed no cut here
    assert count >= 1 and result[3].text.endswith(f"{2 * MiB} bytes in full]")
    for message_ in result:
        for call in message_.tool_calls:
            json.loads(call.arguments)  # cut arguments stay valid JSON


def test_a_request_that_cannot_fit_is_refused() -> None:
    messages = [ModelMessage(Role.USER, "x" * (10 * KiB)) for _ in range(20)]
    assert fit(messages, 20 * FLOOR_BYTES, encoded) is None
