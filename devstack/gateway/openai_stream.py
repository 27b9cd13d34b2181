"""Reading a Chat Completions stream (OpenAI's streaming API reference) into provider chunks.

The body is Server-Sent Events: ``data: <JSON chunk>`` events separated by blank lines,
``:`` comment lines (keep-alives, which are not model output), and ``data: [DONE]`` at the
end. Each chunk is a ``chat.completion.chunk`` whose ``choices[0].delta`` may carry
``content``, ``refusal``, ``tool_calls`` fragments and, on servers that expose thinking
(DeepSeek, vLLM, Ollama, OpenRouter), ``reasoning_content`` or ``reasoning``; a choice's
``finish_reason`` is set once; ``usage`` comes in a last chunk with empty ``choices`` (or,
on some servers, in the last choice chunk).

What this module decides (docs/decisions/0142-openai-stream-reading.md):

- **Tool calls are assembled by id where ids are given and by index otherwise.** A
  fragment with an id continues the call of that id (when its index, if any, agrees); an
  id not seen yet starts a call, so calls with distinct ids are never merged, even when
  they share ``index: 0`` or carry no index (as Ollama sends parallel calls). A fragment
  without an id continues the call of its index, or the last call when it has no index
  either. A fragment that names a tool again for a call whose arguments are already
  complete JSON starts a new call (servers that number every call ``call_0``). A call is
  started (``ToolCallStartChunk``) once its name is known and numbered in that order;
  calls without an id get one made up. A call that never got a name is started, with an
  empty name, after the last fragment of an answer that ended whole: the model made it,
  so the planner answers it with an error result, and the answer's other calls run
  (decision 0223).
- **The end.** ``finish_reason`` as given: ``stop`` (``tool_calls`` when the answer has
  calls), ``tool_calls``/``function_call``, ``length``, ``content_filter``; a ``refusal``
  delta makes the finish ``REFUSAL`` and its text comes as text. A body that ends with
  neither a finish reason nor ``[DONE]`` is ``TRUNCATED``, never a completed answer (an
  event cut mid-line is dropped, as the SSE rules say). ``[DONE]`` without a finish
  reason is a whole answer.
- **Errors.** An error event (``{"error": ...}``, or ``event: error``) is UNAVAILABLE, as
  is a chunk that is not JSON (``PROVIDER_STREAM_MALFORMED``): both are retryable while
  nothing was shown. ``finish_reason: "error"`` is UNAVAILABLE too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from devstack.gateway.base import (
    FinishChunk,
    FinishReason,
    ProviderChunk,
    ProviderError,
    ReasoningChunk,
    TextChunk,
    ToolCallDeltaChunk,
    ToolCallStartChunk,
    Usage,
    new_tool_call_id,
)

REASON_STREAM_MALFORMED = "PROVIDER_STREAM_MALFORMED"
REASON_STREAM_ERROR = "PROVIDER_STREAM_ERROR"

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,
    "length": FinishReason.LENGTH,
    "content_filter": FinishReason.CONTENT_FILTER,
}
_REASONING_FIELDS = ("reasoning_content", "reasoning")


# --------------------------------------------------------------------------- SSE


@dataclass
class _Event:
    event: str
    data: str


class SseDecoder:
    """Server-Sent Events from bytes, per the WHATWG rules (``data``/``event`` fields,
    ``:`` comments, CR, LF or CRLF line ends). An event is dispatched at its blank line;
    at the end of the body, an event whose lines all ended is dispatched too, but a line
    cut in the middle is dropped (it is not a whole event)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> Iterator[_Event]:
        self._buffer += chunk
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return
            end, after = cut
            line = self._buffer[:end].decode("utf-8", errors="replace")
            self._buffer = self._buffer[after:]
            event = self._line(line)
            if event is not None:
                yield event

    def end(self) -> Iterator[_Event]:
        # A trailing CR alone is a whole line end.
        if self._buffer.endswith(b"\r"):
            yield from self.feed(b"\n")
        if self._data:
            yield self._dispatch()

    def _line(self, line: str) -> _Event | None:
        if not line:
            return self._dispatch() if self._data else None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None

    def _dispatch(self) -> _Event:
        event = _Event(self._event, "\n".join(self._data))
        self._data = []
        self._event = ""
        return event


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """Where the first line of ``buffer`` ends and the next begins, or None when no line
    is complete yet (a CR at the very end may be the first half of a CRLF)."""
    for index, byte in enumerate(buffer):
        if byte == 0x0A:
            return index, index + 1
        if byte == 0x0D:
            if index + 1 == len(buffer):
                return None
            return index, index + 2 if buffer[index + 1] == 0x0A else index + 1
    return None


# --------------------------------------------------------------------------- tool calls


@dataclass
class _Call:
    call_id: str
    provider_index: int | None
    id_given: bool
    name: str = ""
    arguments: str = ""
    position: int | None = None
    pending: list[str] = field(default_factory=list)

    def complete_json(self) -> bool:
        if not self.arguments.strip():
            return False
        try:
            json.loads(self.arguments)
        except ValueError:
            return False
        return True


class ToolCallAssembler:
    """Tool-call fragments to ``ToolCallStartChunk``/``ToolCallDeltaChunk``s (see the
    module docstring for the rules)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.started = 0

    def add(self, fragment: object) -> list[ProviderChunk]:
        if not isinstance(fragment, dict):
            raise _malformed("a tool_calls entry that is not an object")
        call_id = _text(fragment.get("id"))
        index = fragment.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            index = None
        function = fragment.get("function")
        function = function if isinstance(function, dict) else {}
        name = _text(function.get("name"))
        arguments = _text(function.get("arguments"))
        call = self._call_for(call_id, index, name)
        out: list[ProviderChunk] = []
        if name and not call.name:
            call.name = name
        if arguments:
            call.arguments += arguments
            call.pending.append(arguments)
        if call.position is None and call.name:
            call.position = self.started
            self.started += 1
            out.append(ToolCallStartChunk(call.position, call.call_id, call.name))
        if call.position is not None and call.pending:
            out.extend(ToolCallDeltaChunk(call.position, piece) for piece in call.pending)
            call.pending.clear()
        return out

    def _call_for(self, call_id: str, index: int | None, name: str) -> _Call:
        last = self.calls[-1] if self.calls else None
        if call_id:
            for call in reversed(self.calls):
                if call.call_id != call_id:
                    continue
                if index is not None and call.provider_index not in (None, index):
                    break
                if name and call.name and call.complete_json():
                    break
                return call
            for call in reversed(self.calls):
                # An id that comes after the call's first fragment.
                if index is not None and call.provider_index == index and not call.id_given:
                    call.id_given = True
                    if call.position is None:
                        call.call_id = call_id
                    return call
            return self._new(call_id, index)
        if index is not None:
            for call in reversed(self.calls):
                if call.provider_index == index:
                    if name and call.name and call.complete_json():
                        break
                    return call
            return self._new("", index)
        if last is not None and not (name and last.name and last.complete_json()):
            return last
        return self._new("", None)

    def _new(self, call_id: str, index: int | None) -> _Call:
        call = _Call(call_id or new_tool_call_id(), index, id_given=bool(call_id))
        self.calls.append(call)
        return call

    def start_unnamed(self) -> list[ProviderChunk]:
        """Start, with an empty name, every call that never got one, and send its
        arguments: the end of an answer that ended whole."""
        out: list[ProviderChunk] = []
        for call in self.calls:
            if call.position is None:
                call.position = self.started
                self.started += 1
                out.append(ToolCallStartChunk(call.position, call.call_id, ""))
                out.extend(ToolCallDeltaChunk(call.position, piece) for piece in call.pending)
                call.pending.clear()
        return out


# --------------------------------------------------------------------------- the stream


@dataclass
class StreamState:
    """What the stream said so far: used by the caller for error messages."""

    events: int = 0
    output: int = 0


class ChunkReader:
    """One Chat Completions stream, event by event, as provider chunks."""

    def __init__(self) -> None:
        self.calls = ToolCallAssembler()
        self.finish_reason: str | None = None
        self.done = False
        self.refused = False
        self.usage: Usage | None = None
        self.model = ""
        self.state = StreamState()

    def event(self, event: _Event) -> list[ProviderChunk]:
        self.state.events += 1
        data = event.data.strip()
        if data == "[DONE]":
            self.done = True
            return []
        if not data:
            return []
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise _malformed(f"a chunk that is not JSON ({data[:80]!r})") from exc
        if not isinstance(chunk, dict):
            raise _malformed(f"a chunk that is not a JSON object ({data[:80]!r})")
        if event.event == "error" or chunk.get("error") is not None:
            raise _stream_error(chunk.get("error", chunk))
        model = chunk.get("model")
        if isinstance(model, str) and model and not self.model:
            self.model = model[:200]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(
                _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
            )
        out: list[ProviderChunk] = []
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            # Only choice 0 exists: the request never sets n > 1.
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            out.extend(self._delta(choice.get("delta")))
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason
        self.state.output += len(out)
        return out

    def _delta(self, delta: object) -> list[ProviderChunk]:
        if not isinstance(delta, dict):
            return []
        out: list[ProviderChunk] = []
        for name in _REASONING_FIELDS:
            thought = delta.get(name)
            if isinstance(thought, str) and thought:
                out.append(ReasoningChunk(len(thought), thought))
        content = delta.get("content")
        if isinstance(content, str) and content:
            out.append(TextChunk(content))
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self.refused = True
            out.append(TextChunk(refusal))
        fragments = delta.get("tool_calls")
        for fragment in fragments if isinstance(fragments, list) else ():
            out.extend(self.calls.add(fragment))
        return out

    def finish(self) -> FinishChunk:
        """The finish of a body that ended (see the module docstring)."""
        provider_reason = self.finish_reason or ""
        if self.finish_reason is None and not self.done:
            return FinishChunk(FinishReason.TRUNCATED, self.usage, provider_reason, self.model)
        if self.finish_reason == "error":
            raise ProviderError(
                grpc.StatusCode.UNAVAILABLE,
                "the model's stream ended with finish_reason 'error'",
                reason=REASON_STREAM_ERROR,
            )
        reason = _FINISH_REASONS.get(self.finish_reason or "", FinishReason.STOP)
        if self.refused and reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
            reason = FinishReason.REFUSAL
        if reason is FinishReason.STOP and self.calls.calls:
            # Some local servers finish tool calls with "stop".
            reason = FinishReason.TOOL_CALLS
        return FinishChunk(reason, self.usage, provider_reason, self.model)


async def read_stream(
    body: AsyncIterator[bytes], reader: ChunkReader
) -> AsyncIterator[ProviderChunk]:
    """The provider chunks of a body, then its ``FinishChunk``. Transport errors of
    ``body`` pass through for the caller to translate."""
    decoder = SseDecoder()
    async for piece in body:
        for event in decoder.feed(piece):
            for chunk in reader.event(event):
                yield chunk
            if reader.done:
                break
        if reader.done:
            break
    else:
        for event in decoder.end():
            for chunk in reader.event(event):
                yield chunk
    finish = reader.finish()
    if finish.reason.whole:
        for chunk in reader.calls.start_unnamed():
            yield chunk
    yield finish


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _malformed(what: str) -> ProviderError:
    return ProviderError(
        grpc.StatusCode.UNAVAILABLE,
        f"the model's stream sent {what}",
        reason=REASON_STREAM_MALFORMED,
    )


def _stream_error(error: object) -> ProviderError:
    message = ""
    if isinstance(error, dict):
        message = _text(error.get("message")) or json.dumps(error)[:300]
    elif isinstance(error, str):
        message = error
    return ProviderError(
        grpc.StatusCode.UNAVAILABLE,
        f"the model's stream failed: {message or 'an error event'}",
        reason=REASON_STREAM_ERROR,
    )
