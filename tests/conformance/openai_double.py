"""A hostile OpenAI-compatible Chat Completions server for the provider conformance suite.

Written from OpenAI's published API reference for streaming chat completions, not from
recordings: ``POST /v1/chat/completions`` with ``stream: true`` answers
``text/event-stream``, one ``data: <chat.completion.chunk JSON>`` event per chunk, each
followed by a blank line; each chunk has ``id``, ``object``, ``created``, ``model``,
``system_fingerprint`` and ``choices`` (``index``, ``delta`` with ``role``, ``content``,
``refusal``, ``tool_calls`` fragments of ``index``, ``id``, ``type``, ``function.name``,
``function.arguments``; ``logprobs``; ``finish_reason``), plus ``usage: null`` while
``stream_options.include_usage`` is set, and then one last chunk with empty ``choices`` and
the usage; the body ends with ``data: [DONE]``. Errors are a JSON ``{"error": {"message",
"type", "param", "code"}}`` with the HTTP status.

It is an asyncio server speaking HTTP/1.1 by hand, so that a test controls every byte:
a body can stop anywhere (``end="eof"``: a clean close, the body complete as far as HTTP
goes), be reset (``end="reset"``), or hang until the test ends (``end="hang"``), and
pieces can be delayed. Each request takes the next ``Reply`` of the queue; the last one
repeats. Every request is recorded (path, headers, JSON body).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

End = Literal["done", "eof", "reset", "hang"]


@dataclass
class Piece:
    """Bytes written after ``delay_s`` seconds (the model's pace, not a test's wait)."""

    data: bytes
    delay_s: float = 0.0


@dataclass
class Reply:
    """One HTTP answer. ``end``: ``done`` closes after the pieces (a whole body), ``eof``
    too (the pieces decide whether the SSE stream was complete), ``reset`` aborts the
    connection after the pieces, ``hang`` keeps it open until the double stops."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    pieces: list[Piece] = field(default_factory=list)
    end: End = "done"


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


_REASONS = {
    200: "OK",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class OpenAIDouble:
    """The server; ``base_url`` is ``http://127.0.0.1:<port>/v1``."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.received: list[Received] = []
        self._server: asyncio.Server | None = None
        self._stop = asyncio.Event()
        self._port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def reset(self, replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.received.clear()
        self._stop.set()
        self._stop = asyncio.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stop = self._stop
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in header_lines if line)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.received.append(Received(request_line.split()[1], headers, json.loads(body)))
            reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
            status_line = f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}\r\n"
            fixed = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
            if reply.status != 200:
                payload = b"".join(piece.data for piece in reply.pieces)
                writer.write(
                    (
                        status_line + fixed + f"content-length: {len(payload)}\r\n"
                        "connection: close\r\n\r\n"
                    ).encode()
                    + payload
                )
                await writer.drain()
                return
            writer.write((status_line + fixed + "connection: close\r\n\r\n").encode())
            await writer.drain()
            for piece in reply.pieces:
                if piece.delay_s:
                    await asyncio.sleep(piece.delay_s)
                writer.write(piece.data)
                await writer.drain()
            if reply.end == "reset":
                # Linger 0: the close sends a TCP reset, not an orderly end of the body.
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            elif reply.end == "hang":
                await stop.wait()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if not writer.transport.is_closing():
                writer.close()


# --------------------------------------------------------------------------- SSE builders


def event(payload: dict[str, Any] | str) -> bytes:
    """One SSE event: ``data: <JSON>`` (or the literal text) and a blank line."""
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n".encode()


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice (index 0)."""
    return {
        "id": "chatcmpl-double",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "double-1",
        "system_fingerprint": "fp_double",
        "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }


def usage_chunk(prompt: int = 11, completion: int = 7) -> dict[str, Any]:
    """The last chunk when ``include_usage`` is set: empty ``choices``, the usage."""
    return {
        "id": "chatcmpl-double",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "double-1",
        "system_fingerprint": "fp_double",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def call_fragment(
    index: int | None = None,
    call_id: str | None = None,
    name: str | None = None,
    arguments: str | None = None,
) -> dict[str, Any]:
    """A ``delta.tool_calls`` entry; None leaves a field out."""
    fragment: dict[str, Any] = {}
    if index is not None:
        fragment["index"] = index
    if call_id is not None:
        fragment["id"] = call_id
        fragment["type"] = "function"
    function: dict[str, str] = {}
    if name is not None:
        function["name"] = name
    if arguments is not None:
        function["arguments"] = arguments
    if function:
        fragment["function"] = function
    return fragment


def calls_delta(*fragments: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": list(fragments)}


def sse(*chunks: dict[str, Any] | str, delay_s: float = 0.0) -> list[Piece]:
    """Pieces for events, each ``delay_s`` after the previous one."""
    return [Piece(event(c), delay_s) for c in chunks]


def error_body(message: str, type_: str, code: str | None) -> list[Piece]:
    return [
        Piece(
            json.dumps(
                {"error": {"message": message, "type": type_, "param": None, "code": code}}
            ).encode()
        )
    ]
