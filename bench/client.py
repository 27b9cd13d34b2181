"""The benchmark's planner client: Chat streams driven the way Core's realtime gateway
drives them (docs/spec/api-and-streams.md), plus direct calls to the dependencies for comparison.

Each ``ChatStream`` is one bidirectional ``Chat`` call carrying one session. A turn is
timed from just before ``send_message`` is written to the moment its ``turn_ended``
event is read; nothing else runs between them on that stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from ballet.llm.v1 import gateway_pb2, gateway_pb2_grpc
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc, resources_pb2
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc

from ballet_common.tokens import (
    GATEWAY_AUDIENCE,
    HUMAN_AUDIENCES,
    PLANNER_SERVICE_SUBJECT,
    TRACKER_AUDIENCE,
    dev_secret,
    mint_dev_service_token,
    mint_dev_token,
)
from bench.stack import STAMP

#: Client channel options. Each channel gets its own connection: grpc shares one
#: connection among channels to the same target by default (a global subchannel pool),
#: and the planner allows 1,000 concurrent streams per connection
#: (server.max_concurrent_streams): the 1,001st Chat call on a shared connection waits,
#: without an error, until another ends.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.use_local_subchannel_pool", 1),
]


#: Longest a client waits for an answer before calling the stream stuck (seconds).
STUCK_S = 60.0


class ChatError(RuntimeError):
    """The planner refused a client message, the stream ended unexpectedly, or nothing
    came for ``STUCK_S`` seconds."""


@dataclass
class TurnResult:
    """One turn as the client saw it. Times are seconds (``time.perf_counter``);
    ``stamps`` are the gateway's emit times of ``STAMP`` deltas (monotonic ns) with the
    client's receive time (monotonic ns)."""

    turn_id: str
    reason: str
    latency_s: float
    first_delta_s: float | None = None
    deltas: int = 0
    chars: int = 0
    delta_span_s: float = 0.0
    stamps: list[tuple[int, int]] = field(default_factory=list)


class Tokens:
    """Dev tokens of the benchmark's humans, minted once from the data dir's secret."""

    def __init__(self, data_dir: Path) -> None:
        self._secret = dev_secret(data_dir)
        self._cache: dict[str, str] = {}

    def human(self, user: str) -> str:
        token = self._cache.get(user)
        if token is None:
            token = mint_dev_token(
                self._secret,
                user,
                organization_id="acme",
                audiences=HUMAN_AUDIENCES,
                ttl_s=6 * 3600,
            )
            self._cache[user] = token
        return token

    def planner(self, audience: str) -> str:
        """The planner's dev service credential for one dependency ``audience`` (as the
        planner mints it)."""
        return mint_dev_service_token(self._secret, PLANNER_SERVICE_SUBJECT, audiences=(audience,))


def channel(address: str) -> grpc.aio.Channel:
    """A plaintext loopback channel."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class ChatStream:
    """One open ``Chat`` stream of one human."""

    def __init__(self, chan: grpc.aio.Channel, token: str) -> None:
        stub = planner_service_pb2_grpc.PlannerServiceStub(chan)
        self.call: Any = stub.Chat(metadata=(("authorization", f"Bearer {token}"),))
        self.session_id = ""
        self.last_sequence = 0
        #: Heartbeats read by ``wait_closed``.
        self.heartbeats = 0

    async def _read(self) -> chat_pb2.ChatResponse:
        try:
            async with asyncio.timeout(STUCK_S):
                response = await self.call.read()
        except TimeoutError as error:
            raise ChatError(f"nothing came on the stream for {STUCK_S:g} s") from error
        except grpc.aio.AioRpcError as error:
            raise ChatError(f"the stream ended: {error.code().name}: {error.details()}") from error
        if response is grpc.aio.EOF:
            raise ChatError("the stream ended without an error")
        assert isinstance(response, chat_pb2.ChatResponse)
        if response.WhichOneof("event") == "error":
            raise ChatError(f"refused: {response.error.code} {response.error.message}")
        if response.sequence:
            self.last_sequence = response.sequence
        return response

    async def _write(self, request: chat_pb2.ChatRequest) -> None:
        try:
            async with asyncio.timeout(STUCK_S):
                await self.call.write(request)
        except TimeoutError as error:
            # A call that cannot start waits here, e.g. beyond the server's concurrent
            # streams on one connection.
            raise ChatError(f"the stream took no message for {STUCK_S:g} s") from error
        except grpc.aio.AioRpcError as error:
            raise ChatError(f"the stream ended: {error.code().name}: {error.details()}") from error

    async def open(
        self,
        *,
        project_id: str = "",
        session_id: str = "",
        after_sequence: int = 0,
        title: str = "bench",
    ) -> str:
        """Open (and with ``project_id``, create) the stream's session; its id."""
        action = chat_pb2.OpenAction(
            session_id=session_id,
            project_id=project_id if not session_id else "",
            title=title if not session_id else "",
            after_sequence=after_sequence,
        )
        await self._write(chat_pb2.ChatRequest(request_id=uuid.uuid4().hex, open=action))
        while True:
            response = await self._read()
            if response.WhichOneof("event") == "session_opened":
                self.session_id = response.session_opened.session.session_id
                self.last_sequence = max(after_sequence, self.last_sequence)
                if not after_sequence:
                    self.last_sequence = response.session_opened.session.last_sequence
                return self.session_id

    async def turn(self, text: str) -> TurnResult:
        """Send ``text`` and read until its turn ends (see the module docstring)."""
        request = chat_pb2.ChatRequest(
            request_id=uuid.uuid4().hex, send_message=chat_pb2.SendMessageAction(text=text)
        )
        started = time.perf_counter()
        await self._write(request)
        turn_id = ""
        result = TurnResult("", "", 0.0)
        first_delta_at = last_delta_at = 0.0
        while True:
            response = await self._read()
            kind = response.WhichOneof("event")
            if kind == "message_accepted" and not turn_id:
                turn_id = response.turn_id
            elif kind == "text_delta":
                now = time.perf_counter()
                if not result.deltas:
                    first_delta_at = now
                    result.first_delta_s = now - started
                last_delta_at = now
                result.deltas += 1
                delta_text = response.text_delta.text
                result.chars += len(delta_text)
                if delta_text.startswith(STAMP):
                    result.stamps.append((int(delta_text[len(STAMP) :]), time.monotonic_ns()))
            elif kind == "turn_ended" and response.turn_id == turn_id:
                result.latency_s = time.perf_counter() - started
                result.turn_id = turn_id
                result.reason = resources_pb2.TurnEndReason.Name(response.turn_ended.reason)
                result.delta_span_s = last_delta_at - first_delta_at
                return result

    async def wait_closed(self) -> str:
        """Wait until the stream ends or delivers anything but heartbeats (an idle stream
        should not); returns what happened. Heartbeats are counted in ``heartbeats``."""
        while True:
            try:
                response = await self.call.read()
            except grpc.aio.AioRpcError as error:
                return f"ended: {error.code().name}"
            if response is grpc.aio.EOF:
                return "ended"
            kind = response.WhichOneof("event")
            if kind != "heartbeat":
                return f"event: {kind}"
            self.heartbeats += 1

    def cancel(self) -> None:
        self.call.cancel()


# --------------------------------------------------------------------------- dependencies


class Dependencies:
    """Direct calls to the stack's gateway and tracker, made the way the planner makes
    them, so a planner figure can be set beside the dependency calls it contains."""

    def __init__(self, chan: grpc.aio.Channel, tokens: Tokens, human: str) -> None:
        self.gateway = gateway_pb2_grpc.GatewayServiceStub(chan)
        self.tracker = tracker_pb2_grpc.TrackerServiceStub(chan)
        self.metadata = (
            ("authorization", f"Bearer {tokens.human(human)}"),
            ("x-ballet-actor", "planner:bench"),
            ("x-ballet-service-authorization", f"Bearer {tokens.planner(TRACKER_AUDIENCE)}"),
        )
        self.gateway_metadata = (
            ("x-ballet-service-authorization", f"Bearer {tokens.planner(GATEWAY_AUDIENCE)}"),
        )

    @staticmethod
    def request(text: str, system_prompt: str = "") -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            project_id="demo",
            credential_ref="demo-credential",
            model="bench",
            purpose=gateway_pb2.PURPOSE_TURN,
            system_prompt=system_prompt,
            messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, text=text)],
            request_id=uuid.uuid4().hex,
        )

    async def generate(self, text: str) -> TurnResult:
        """One model call; ``latency_s`` to its end, ``first_delta_s`` to its first delta."""
        result = TurnResult("", "", 0.0)
        started = time.perf_counter()
        first = last = 0.0
        call = self.gateway.Generate(self.request(text), metadata=self.gateway_metadata)
        async for response in call:
            if response.WhichOneof("chunk") == "text_delta":
                now = time.perf_counter()
                if not result.deltas:
                    first = now
                    result.first_delta_s = now - started
                last = now
                result.deltas += 1
                result.chars += len(response.text_delta.text)
                if response.text_delta.text.startswith(STAMP):
                    stamp = int(response.text_delta.text[len(STAMP) :])
                    result.stamps.append((stamp, time.monotonic_ns()))
        result.latency_s = time.perf_counter() - started
        result.delta_span_s = last - first
        return result

    async def get_item(self, project_id: str, item_id: str) -> float:
        """One ``GetItem`` as the planner's ``get_item`` tool makes it; seconds."""
        started = time.perf_counter()
        await self.tracker.GetItem(
            tracker_pb2.GetItemRequest(project_id=project_id, item_id=item_id),
            metadata=self.metadata,
            timeout=15,
        )
        return time.perf_counter() - started
