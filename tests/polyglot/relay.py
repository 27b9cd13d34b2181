"""A TCP relay on loopback for connection tests: forwards bytes both ways between its
clients and one upstream address, until ``black_hole`` makes it stop forwarding while
it keeps every socket open (a peer that vanished without a FIN or RST: a pulled cable,
a dead NAT entry, a frozen VM).

It runs its own event loop in a thread, so a test can use it from synchronous code
(subprocesses, nginx) and from asyncio tests alike.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Relay:
    """``address`` (``127.0.0.1:port``) forwards to ``upstream`` (``host:port``)."""

    def __init__(self, upstream: str) -> None:
        self.upstream_host, _, port = upstream.rpartition(":")
        self.upstream_port = int(port)
        self.address = ""
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def black_hole(self) -> None:
        """From now on, forward nothing in either direction; keep the sockets open."""
        self._forwarding.clear()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        self._writers += [writer, up_writer]
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if not self._forwarding.is_set():
                # Black-holed: swallow everything; the peer sees silence, not a close.
                continue
            writer.write(data)
            await writer.drain()
        if self._forwarding.is_set():
            writer.close()


@contextmanager
def relay(upstream: str) -> Iterator[Relay]:
    """A started ``Relay`` to ``upstream``, stopped at the end."""
    hop = Relay(upstream).start()
    try:
        yield hop
    finally:
        hop.stop()
