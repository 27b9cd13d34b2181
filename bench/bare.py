"""Bare gRPC baselines: an echo server in its own process and the client measurements.

``python -m bench.bare`` serves three methods on a free loopback port and prints
``{"address": "127.0.0.1:PORT"}`` when ready, then runs until SIGTERM:

- ``/bench.Bare/Unary``: echoes the request bytes (a unary call);
- ``/bench.Bare/Stream``: the request is a decimal count N; streams N messages of
  ``MESSAGE_BYTES`` bytes (a server stream: with N = 1 the cost of a new streaming
  call, with large N the messages per second one stream carries);
- ``/bench.Bare/PingPong``: a bidirectional stream echoing each message (the cost of one
  exchange on an open stream).

Messages are raw bytes (no protobuf): these are the limits of grpc.aio on loopback with
this process layout, the floor under every planner figure (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

SERVICE = "bench.Bare"
#: The size of one streamed message: about a small text delta with its envelope.
MESSAGE_BYTES = 32
_PAYLOAD = b"x" * MESSAGE_BYTES


async def _unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


async def _stream(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    for _ in range(int(request)):
        yield _PAYLOAD


async def _ping_pong(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


def _handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "Stream": grpc.unary_stream_rpc_method_handler(_stream),
            "PingPong": grpc.stream_stream_rpc_method_handler(_ping_pong),
        },
    )


async def serve() -> None:
    """Serve until SIGTERM or SIGINT."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"address": f"127.0.0.1:{port}"}), flush=True)
    await stop.wait()
    await server.stop(0)


# --------------------------------------------------------------------------- the client


class BareClient:
    """Calls on the bare server over one channel; every method returns seconds."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self._unary = self.channel.unary_unary(f"/{SERVICE}/Unary")
        self._stream = self.channel.unary_stream(f"/{SERVICE}/Stream")
        self._ping_pong = self.channel.stream_stream(f"/{SERVICE}/PingPong")

    async def close(self) -> None:
        await self.channel.close()

    async def unary(self, count: int) -> list[float]:
        """``count`` sequential unary echoes; each call's latency."""
        times = []
        for _ in range(count):
            started = time.perf_counter()
            await self._unary(_PAYLOAD)
            times.append(time.perf_counter() - started)
        return times

    async def new_stream(self, count: int) -> list[float]:
        """``count`` sequential new server-streaming calls of one message each, read to
        their end; each call's latency."""
        times = []
        for _ in range(count):
            started = time.perf_counter()
            async for _message in self._stream(b"1"):
                pass
            times.append(time.perf_counter() - started)
        return times

    async def ping_pong(self, count: int) -> list[float]:
        """``count`` write-then-read exchanges on one open bidirectional stream."""
        call = self._ping_pong()
        times = []
        try:
            for _ in range(count):
                started = time.perf_counter()
                await call.write(_PAYLOAD)
                await call.read()
                times.append(time.perf_counter() - started)
            await call.done_writing()
            await call.read()
        finally:
            call.cancel()
        return times

    async def stream_rate(self, messages: int) -> float:
        """Messages per second of one server stream of ``messages`` small messages,
        from the call to its end."""
        started = time.perf_counter()
        received = 0
        async for _message in self._stream(str(messages).encode()):
            received += 1
        elapsed = time.perf_counter() - started
        if received != messages:
            raise RuntimeError(f"the bare stream sent {received} of {messages} messages")
        return messages / elapsed


if __name__ == "__main__":
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(130)
