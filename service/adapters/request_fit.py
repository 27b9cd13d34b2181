"""A model request cut to fit the gateway's channel (decision 0224).

Every request sends the conversation back to the gateway: each answer's text, each
call's arguments, each result. Stored bounds keep most of it small (tool results, tool-call
arguments, human messages), but an answer's text is as long as the model made it, and a
gateway's receive limit may be lower than ``dependencies.gateway.max_message_bytes``
says. A request the gateway refuses for its size would be refused again on every later
turn of the session, so a request over its limit is cut before it is sent:

- the largest messages first (the newest message last of all), each by what the request
  is over, never below ``FLOOR_BYTES``;
- a text to its start and a note saying it was cut and how long it was; tool-call
  arguments and tool results, which are JSON, to ``{"truncated": true,
  "original_bytes": N, "content": ...}`` (``service.core.tools.cut.cut_text``).

The system prompt and the tool declarations are never cut; a request that does not fit
even so is ``MODEL_REQUEST_TOO_LARGE``. The stored transcript is not touched: only what
this request carries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from service.core.ports import ModelMessage, Role, ToolCall
from service.core.tools.cut import cut_text

#: The least a cut message keeps of its content, in UTF-8 bytes.
FLOOR_BYTES = 1024
#: Attempts at cutting: each re-encodes the request and cuts by what it is still over
#: (the notes and the JSON around cut content add a little).
_PASSES = 4


def content_bytes(message: ModelMessage) -> int:
    """The UTF-8 bytes of a message's text and its calls' arguments."""
    return len(message.text.encode()) + sum(len(c.arguments.encode()) for c in message.tool_calls)


def fit(
    messages: Sequence[ModelMessage], limit: int, encoded_size: Callable[[list[ModelMessage]], int]
) -> tuple[list[ModelMessage], int] | None:
    """``messages`` cut so that ``encoded_size`` (the whole request's bytes with these
    messages) is at most ``limit``, and how many were cut; None when they cannot be cut
    enough (every one at ``FLOOR_BYTES``)."""
    fitted = list(messages)
    cut: set[int] = set()
    newest = len(fitted) - 1
    for _ in range(_PASSES):
        over = encoded_size(fitted) - limit
        if over <= 0:
            return fitted, len(cut)
        order = sorted(
            range(len(fitted)),
            key=lambda i: (i == newest, -content_bytes(fitted[i]), i),
        )
        for index in order:
            size = content_bytes(fitted[index])
            if size <= FLOOR_BYTES:
                continue
            keep = max(FLOOR_BYTES, size - over)
            fitted[index] = cut_message(fitted[index], keep)
            cut.add(index)
            over -= size - content_bytes(fitted[index])
            if over <= 0:
                break
    return (fitted, len(cut)) if encoded_size(fitted) <= limit else None


def cut_message(message: ModelMessage, keep: int) -> ModelMessage:
    """``message`` with its text and arguments cut, largest first, to about ``keep``
    UTF-8 bytes in all (each cut field keeps at least what its marker needs)."""
    fields: list[tuple[int, int]] = [(-1, len(message.text.encode()))]
    fields += [(i, len(c.arguments.encode())) for i, c in enumerate(message.tool_calls)]
    used = sum(size for _, size in fields)
    text = message.text
    calls = list(message.tool_calls)
    for where, size in sorted(fields, key=lambda field: field[1], reverse=True):
        if used <= keep:
            break
        room = max(0, keep - (used - size))
        if where < 0:
            text = (
                _cut_json(text, room, size) if message.role is Role.TOOL else _cut(text, room, size)
            )
            used += len(text.encode()) - size
        else:
            call = calls[where]
            arguments = _cut_json(call.arguments, room, size)
            calls[where] = ToolCall(call.call_id, call.name, arguments)
            used += len(arguments.encode()) - size
    return replace(message, text=text, tool_calls=tuple(calls))


def _cut_json(text: str, room: int, size: int) -> str:
    return cut_text(text, max(room, 128), size)


def _cut(text: str, room: int, size: int) -> str:
    note = f"\n[cut to fit the gateway's message limit: {size} bytes in full]"
    budget = max(0, room - len(note.encode()))
    return text.encode()[:budget].decode("utf-8", "ignore") + note
