"""What a client is sent of a transcript message: the message, or a copy cut to fit
(decision 0222).

A gRPC client takes messages of at most 4 MiB unless it raised its limit, so one Chat
event or one ``ListMessages`` entry larger than that would end the client's stream or
call, and the same message would end it again on every replay. The stored transcript is
bounded (human text by ``limits.message_max_bytes``, tool results by
``planner.tool_result_max_bytes``, tool-call arguments by
``planner.tool_arguments_max_bytes``) except an answer's text, which is as long as the
model made it. A message larger than ``limits.client_message_max_bytes`` is sent as a
copy whose longest fields are cut until it fits: text to its first characters, the JSON
fields (tool-call arguments and results) to ``{"truncated": true, "original_bytes": N,
"content": ...}`` (``service.core.tools.cut.cut_text``), so they stay valid JSON. The
copy is marked ``truncated``, with the longest field's full UTF-8 size in
``original_bytes``; the stored message is unchanged.

A text delta longer than the bound keeps its end, at its own offset: the deltas after it
continue from there, and the ``assistant_message`` carries the text.

Sizes come from ``Message.size_bytes`` (computed once per message), so a message that
fits, nearly every one, costs one comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from service.core.model import Message, SessionEvent, TextDelta
from service.core.tools.cut import cut_text

#: Bytes a message's encoding may hold besides its text, arguments, result and name:
#: ids, times, usage, the event around it. Generous: the bound only needs to keep a
#: message below the client's limit.
MESSAGE_OVERHEAD_BYTES = 4096
#: The default bound (``limits.client_message_max_bytes``): 1 MiB below gRPC's default
#: receive limit of 4 MiB.
CLIENT_MESSAGE_MAX_BYTES = 3 * 1024 * 1024

#: The least one message of a response holding several is cut to.
MIN_SHARE_BYTES = 16 * 1024

_JSON_FIELDS = ("tool_arguments", "tool_result")
_CUT_FIELDS = ("text", "tool_arguments", "tool_result")


def message_for_client(message: Message, max_bytes: int = CLIENT_MESSAGE_MAX_BYTES) -> Message:
    """``message`` when it fits ``max_bytes`` with its overhead, else a copy cut to fit,
    marked ``truncated`` (see the module docstring). ``max_bytes`` must leave room for
    the overhead and a cut JSON field (at least 64 KiB, as the setting requires)."""
    if message.size_bytes() + MESSAGE_OVERHEAD_BYTES <= max_bytes:
        return message
    sizes = {name: len(getattr(message, name).encode()) for name in _CUT_FIELDS}
    budget = max_bytes - MESSAGE_OVERHEAD_BYTES - len(message.tool_name.encode())
    values = {name: str(getattr(message, name)) for name in _CUT_FIELDS}
    used = sum(sizes.values())
    longest = max(_CUT_FIELDS, key=sizes.__getitem__)
    for name in sorted(_CUT_FIELDS, key=sizes.__getitem__, reverse=True):
        if used <= budget:
            break
        room = max(0, budget - (used - sizes[name]))
        value = values[name]
        cut = cut_text(value, room, sizes[name]) if name in _JSON_FIELDS else _prefix(value, room)
        values[name] = cut
        used += len(cut.encode()) - sizes[name]
    return replace(
        message,
        text=values["text"],
        tool_arguments=values["tool_arguments"],
        tool_result=values["tool_result"],
        truncated=True,
        original_bytes=sizes[longest],
    )


def messages_for_client(
    messages: Sequence[Message], max_bytes: int = CLIENT_MESSAGE_MAX_BYTES
) -> list[Message]:
    """``messages`` sent together in one response (``SendMessage``'s turn) within
    ``max_bytes`` in all: when they do not fit whole, every message larger than an equal
    share of what the smaller ones leave is cut to that share (never below
    ``MIN_SHARE_BYTES``), so the small ones stay whole."""
    sizes = [m.size_bytes() + MESSAGE_OVERHEAD_BYTES for m in messages]
    if sum(sizes) <= max_bytes:
        return list(messages)
    share, left, count = MIN_SHARE_BYTES, max_bytes, len(sizes)
    for size in sorted(sizes):
        # The smallest messages whole; the rest share what is left equally.
        if size * count > left:
            share = max(MIN_SHARE_BYTES, left // count)
            break
        left -= size
        count -= 1
    return [message_for_client(m, share) for m in messages]


def event_for_client(
    event: SessionEvent, max_bytes: int = CLIENT_MESSAGE_MAX_BYTES
) -> SessionEvent:
    """``event``, or a copy whose message is ``message_for_client``'s cut copy."""
    message = event.message
    if message is None:
        return event
    sent = message_for_client(message, max_bytes)
    return event if sent is message else replace(event, message=sent)


def delta_for_client(delta: TextDelta, max_bytes: int = CLIENT_MESSAGE_MAX_BYTES) -> TextDelta:
    """``delta``, or a copy holding the end of its text that fits ``max_bytes`` with the
    overhead, at that end's offset."""
    budget = max_bytes - MESSAGE_OVERHEAD_BYTES
    text = delta.text
    if len(text) * 4 <= budget:
        return delta
    encoded = text.encode()
    if len(encoded) <= budget:
        return delta
    end = encoded[len(encoded) - budget :].decode("utf-8", "ignore")
    return replace(delta, offset=delta.offset + len(text) - len(end), text=end)


def _prefix(text: str, budget: int) -> str:
    """The longest prefix of ``text`` of at most ``budget`` UTF-8 bytes (whole
    characters)."""
    return text.encode()[: max(0, budget)].decode("utf-8", "ignore")
