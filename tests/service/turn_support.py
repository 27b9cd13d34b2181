"""The turn loop's service-test rig: devstack + scripted gateway + planner, over real gRPC.

``start_rig`` starts, on loopback port 0:

- a ``DevStack`` (the tracker, skills and knowledge backends on SQLite, with the built-in
  demo project or an imported beads export) that also serves the LLM gateway
  (``add_gateway_service``) over a ``ScriptedProvider`` whose scenario each test sets;
- a planner (``start_planner``) on SQLite or PostgreSQL whose dependencies are all the
  devstack's address, in dev mode with the devstack's data directory, so both verify the
  same dev tokens and the devstack trusts the planner's service credential.

The provider sleeps through ``GatedSleep``: by default a real ``asyncio.sleep`` (so a
scenario's ``delay_ms`` is a real delay), but a test can hold the model after a number
of deltas and so stop it mid-answer without any wall-clock race.

Nothing here sleeps to wait: ``ChatStream`` awaits the next response (bounded by a
timeout that only turns a hang into a failure), and the few waits without an event
(``eventually``) poll a condition in a bounded loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import grpc
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc, resources_pb2
from ballet.planner.v1 import planner_service_pb2 as pb
from sqlalchemy import event

from ballet_common.tokens import Trust, dev_secret, mint_dev_token
from ballet_common.tracing import Tracing
from devstack.gateway import GatewayServicer, ScriptedProvider, add_gateway_service
from devstack.server import DevStack, DevStackConfig
from service.adapters.store import migrate
from service.server.root import PlannerApp, start_planner
from tests.service.planner_support import auth, planner_settings

#: How long any single wait of a test may take before it fails (seconds). Generous: it
#: only turns a hang into a clear failure; passing tests never wait this long.
WAIT_S = 15.0

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]
Rules = list[dict[str, Any]]


class GatedSleep:
    """The scripted provider's sleep. Passes through to ``asyncio.sleep`` until ``hold``
    is called; then lets ``allowed`` more sleeps pass at once and parks every later one
    until ``release`` (or until the model call is cancelled)."""

    def __init__(self) -> None:
        self._allowed: int | None = None
        self._released = asyncio.Event()
        self.parked = 0
        self._parked_changed = asyncio.Event()

    def hold(self, allowed: int = 0) -> None:
        """Park the model after ``allowed`` more sleeps (``delay_ms`` steps)."""
        self._allowed = allowed
        self._released = asyncio.Event()
        self.parked = 0

    def release(self) -> None:
        """Back to real sleeps; parked sleeps return at once."""
        self._allowed = None
        self._released.set()

    async def wait_parked(self) -> None:
        """Wait until a sleep is parked (the model is held mid-answer)."""
        async with asyncio.timeout(WAIT_S):
            while self.parked == 0:
                self._parked_changed.clear()
                await self._parked_changed.wait()

    async def __call__(self, seconds: float) -> None:
        if self._allowed is None:
            await asyncio.sleep(seconds)
            return
        if self._allowed > 0:
            self._allowed -= 1
            return
        self.parked += 1
        self._parked_changed.set()
        await self._released.wait()


@dataclass
class ChatStream:
    """One ``Chat`` call as a test drives it: write actions, read responses (each read
    bounded by ``wait_s``)."""

    wait_s: ClassVar[float] = WAIT_S
    call: Any
    received: list[chat_pb2.ChatResponse] = field(default_factory=list)

    async def open(
        self, session_id: str = "", *, after_sequence: int = 0, request_id: str = "", **kw: str
    ) -> None:
        await self.call.write(
            chat_pb2.ChatRequest(
                request_id=request_id,
                open=chat_pb2.OpenAction(
                    session_id=session_id, after_sequence=after_sequence, **kw
                ),
            )
        )

    async def send(self, text: str, request_id: str) -> None:
        await self.call.write(
            chat_pb2.ChatRequest(
                request_id=request_id, send_message=chat_pb2.SendMessageAction(text=text)
            )
        )

    async def cancel(self, turn_id: str = "", request_id: str = "") -> None:
        await self.call.write(
            chat_pb2.ChatRequest(
                request_id=request_id, cancel_turn=chat_pb2.CancelTurnAction(turn_id=turn_id)
            )
        )

    async def next(self) -> chat_pb2.ChatResponse:
        """The next response; raises ``EOFError`` when the server ended the stream OK."""
        async with asyncio.timeout(self.wait_s):
            response = await self.call.read()
        if response is grpc.aio.EOF:
            raise EOFError("the Chat stream ended")
        assert isinstance(response, chat_pb2.ChatResponse)
        self.received.append(response)
        return response

    async def until(
        self, predicate: Callable[[chat_pb2.ChatResponse], bool]
    ) -> list[chat_pb2.ChatResponse]:
        """Read until a response satisfies ``predicate``; returns what was read, that one
        included."""
        read: list[chat_pb2.ChatResponse] = []
        while True:
            response = await self.next()
            read.append(response)
            if predicate(response):
                return read

    async def until_kind(self, kind: str) -> list[chat_pb2.ChatResponse]:
        return await self.until(lambda r: r.WhichOneof("event") == kind)

    async def turn(self) -> list[chat_pb2.ChatResponse]:
        """Read until ``turn_ended``."""
        return await self.until_kind("turn_ended")

    async def opened(self) -> resources_pb2.Session:
        """Read the ``session_opened`` reply; an ``error`` reply fails the test."""
        response = (await self.until(lambda r: r.WhichOneof("event") != "text_delta"))[-1]
        assert response.WhichOneof("event") == "session_opened", response
        return response.session_opened.session

    async def done_writing(self) -> None:
        await self.call.done_writing()

    def close(self) -> None:
        self.call.cancel()


@dataclass
class Replica:
    """One planner process of the rig, and a client channel to it."""

    app: PlannerApp
    channel: grpc.aio.Channel
    stub: Any


@dataclass
class Rig:
    """A running devstack + gateway + planner(s), and clients of the planners.

    ``replicas[0]`` is the planner most tests talk to; on PostgreSQL a rig may run more
    replicas on the same database (docs/spec/api-and-streams.md: streams attached to different
    processes). ``gateway_server`` is set when the gateway runs apart from the devstack,
    so a test can stop the tool backends and keep the model.
    """

    stack: DevStack
    gateway: GatewayServicer
    provider: ScriptedProvider
    sleep: GatedSleep
    replicas: list[Replica]
    data_dir: Path
    project_id: str
    database_url: str
    gateway_server: Any = None
    gateway_address: str = ""
    _listeners: list[tuple[str, Any]] = field(default_factory=list)
    _observers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def app(self) -> PlannerApp:
        return self.replicas[0].app

    @property
    def stub(self) -> Any:
        return self.replicas[0].stub

    # ----------------------------------------------------------------- identity

    def token(self, user: str = "alice", **kw: Any) -> str:
        return mint_dev_token(self.stack.dev_secret, user, **kw)

    def meta(self, user: str = "alice") -> Metadata:
        return auth(self.token(user))

    # ----------------------------------------------------------------- the model

    def scenario(self, rules: Rules) -> None:
        """Set the scripted model's rules and forget what it saw so far."""
        self.provider.set_scenario({"rules": rules})
        self.gateway.reset()

    def requests(self, purpose: int = gateway_pb2.PURPOSE_TURN) -> list[Any]:
        """The model requests of one purpose, in arrival order."""
        return [r for r in self.gateway.requests if r.purpose == purpose]

    # ----------------------------------------------------------------- the planner

    async def create_session(self, user: str = "alice", title: str = "") -> resources_pb2.Session:
        response = await self.stub.CreateSession(
            pb.CreateSessionRequest(
                request_id=f"create-{time.monotonic_ns()}",
                project_id=self.project_id,
                title=title,
            ),
            metadata=self.meta(user),
        )
        session: resources_pb2.Session = response.session
        return session

    async def transcript(self, session_id: str, user: str = "alice") -> list[Any]:
        """Every message of a session, all pages."""
        messages: list[Any] = []
        token = ""
        while True:
            page = await self.stub.ListMessages(
                pb.ListMessagesRequest(session_id=session_id, page_size=1000, page_token=token),
                metadata=self.meta(user),
            )
            messages.extend(page.messages)
            token = page.next_page_token
            if not token:
                return messages

    async def get_turn(
        self, session_id: str, turn_id: str, user: str = "alice"
    ) -> resources_pb2.Turn:
        response = await self.stub.GetTurn(
            pb.GetTurnRequest(session_id=session_id, turn_id=turn_id), metadata=self.meta(user)
        )
        turn: resources_pb2.Turn = response.turn
        return turn

    async def get_session(self, session_id: str, user: str = "alice") -> resources_pb2.Session:
        response = await self.stub.GetSession(
            pb.GetSessionRequest(session_id=session_id), metadata=self.meta(user)
        )
        session: resources_pb2.Session = response.session
        return session

    async def ended_turn(self, session_id: str, turn_id: str) -> resources_pb2.Turn:
        """Poll ``GetTurn`` until the turn has ended (for a turn no stream watches)."""
        found: list[resources_pb2.Turn] = []

        async def ended() -> bool:
            turn = await self.get_turn(session_id, turn_id)
            found[:] = [turn]
            return turn.state == resources_pb2.TURN_STATE_ENDED

        await eventually(ended, f"turn {turn_id} to end")
        return found[0]

    @asynccontextmanager
    async def chat(self, user: str = "alice", replica: int = 0) -> AsyncIterator[ChatStream]:
        stream = ChatStream(self.replicas[replica].stub.Chat(metadata=self.meta(user)))
        try:
            yield stream
        finally:
            stream.close()

    async def run_turn(
        self, text: str, *, session_id: str = "", request_id: str = "", user: str = "alice"
    ) -> tuple[str, list[chat_pb2.ChatResponse]]:
        """Open a stream (on a new session unless given), send ``text``, read the turn.

        Returns the session id and everything the stream received.
        """
        after = 0
        if session_id:
            after = (await self.get_session(session_id, user)).last_sequence
        else:
            session_id = (await self.create_session(user)).session_id
        async with self.chat(user) as stream:
            await stream.open(session_id, after_sequence=after)
            await stream.opened()
            await stream.send(text, request_id or f"send-{time.monotonic_ns()}")
            await stream.turn()
            return session_id, stream.received

    # ----------------------------------------------------------------- the database

    @property
    def engine(self) -> Any:
        """The planner's SQLAlchemy engine (the one ``app.store`` uses)."""
        return self.app.database.engine

    def listen(self, name: str, listener: Callable[..., None]) -> None:
        """Add a SQLAlchemy engine event listener, removed when the rig stops."""
        event.listen(self.engine.sync_engine, name, listener)
        self._listeners.append((name, listener))

    def count_commits(self) -> list[int]:
        """Count COMMITs on the planner's engine from now on; returns a one-item list
        holding the live count."""
        counter = [0]

        def on_commit(_conn: Any) -> None:
            counter[0] += 1

        self.listen("commit", on_commit)
        return counter

    def observe_statements(self, observer: Callable[[str, int], None]) -> None:
        """Observe the planner's hot-path statements (PostgreSQL; see ``listen`` for the
        rest), removed when the rig stops."""
        self._observers.append(self.app.database.observe(observer))

    def remove_listeners(self) -> None:
        for stop in self._observers:
            stop()
        self._observers.clear()
        for name, listener in self._listeners:
            event.remove(self.engine.sync_engine, name, listener)
        self._listeners.clear()

    def checked_out(self) -> int:
        """Connections of the planner's pools in use right now."""
        return self.app.database.checked_out()

    async def add_replica(self, settings: Mapping[str, str] | None = None) -> Replica:
        """Start one more planner on the rig's database (PostgreSQL only)."""
        assert self.database_url, "more than one replica needs PostgreSQL"
        replica = await _start_replica(self, dict(settings or {}))
        self.replicas.append(replica)
        return replica


async def _start_replica(
    rig: Rig, overrides: dict[str, str], tracing: Tracing | None = None
) -> Replica:
    if rig.gateway_server is not None:
        overrides["DEPENDENCIES__GATEWAY__ADDRESS"] = rig.gateway_address
    settings = planner_settings(rig.data_dir, rig.stack.address, rig.database_url, **overrides)
    app = await start_planner(settings, tracing=tracing)
    channel = grpc.aio.insecure_channel(app.address)
    return Replica(app, channel, planner_service_pb2_grpc.PlannerServiceStub(channel))


#: Settings that keep the upkeep running on its own clock (lease and stream-slot
#: renewals every ``lease_s / 3``, the sweeper, the heal read) out of a window a test
#: counts commits or statements in, however slowly a loaded machine runs the turn.
QUIET_UPKEEP = {
    "PLANNER__LEASE_S": "300",
    "PLANNER__SWEEP_INTERVAL_S": "100",
    "PLANNER__HEAL_INTERVAL_S": "60",
}


async def start_rig(
    data_dir: Path,
    *,
    database_url: str = "",
    tracker_file: Path | None = None,
    project_id: str = "demo",
    separate_gateway: bool = False,
    settings: Mapping[str, str] | None = None,
    tracing: tuple[Tracing, Tracing] | None = None,
) -> Rig:
    """Start a devstack with the gateway and a planner.

    ``settings`` overrides the planner's settings, keyed ``TABLE__KEY`` (e.g.
    ``{"PLANNER__MAX_ROUNDS": "3"}``, as the environment variables without their
    ``BALLET_PLANNER__`` prefix). ``separate_gateway`` serves the gateway on its own
    server, so stopping the devstack stops only the tool backends. ``tracing`` traces the
    planner and the devstack (in that order); the planner's is shut down with it.
    """
    if database_url:
        await migrate(database_url)
    sleep = GatedSleep()
    provider = ScriptedProvider({"rules": []}, sleep=sleep)
    servicers: list[GatewayServicer] = []
    trust = Trust.dev(dev_secret(data_dir))
    gateway_server: Any = None
    gateway_address = ""
    if separate_gateway:
        gateway_server = grpc.aio.server()
        servicers.append(add_gateway_service(gateway_server, provider, trust=trust))
        gateway_address = f"127.0.0.1:{gateway_server.add_insecure_port('127.0.0.1:0')}"
        await gateway_server.start()
    stack = await DevStack.start(
        DevStackConfig(
            data_dir=data_dir,
            address="127.0.0.1:0",
            tracker_file=tracker_file,
            project_id=project_id,
            extra_services=None
            if separate_gateway
            else lambda server: servicers.append(
                add_gateway_service(server, provider, trust=trust)
            ),
            interceptors=(tracing[1].server_interceptor(),) if tracing else (),
        )
    )
    rig = Rig(
        stack=stack,
        gateway=servicers[0],
        provider=provider,
        sleep=sleep,
        replicas=[],
        data_dir=data_dir,
        project_id=project_id,
        database_url=database_url,
        gateway_server=gateway_server,
        gateway_address=gateway_address,
    )
    try:
        planner_tracing = tracing[0] if tracing else None
        rig.replicas.append(await _start_replica(rig, dict(settings or {}), planner_tracing))
    except BaseException:
        await stack.stop(0)
        if gateway_server is not None:
            await gateway_server.stop(0)
        raise
    return rig


async def stop_rig(rig: Rig) -> None:
    rig.sleep.release()
    rig.stack.faults.clear()
    rig.remove_listeners()
    for replica in rig.replicas:
        await replica.channel.close()
        await replica.app.stop(0)
    await rig.stack.stop(0)
    if rig.gateway_server is not None:
        await rig.gateway_server.stop(0)


def reset(rig: Rig) -> None:
    """Between tests sharing a rig: real sleeps, no faults, no recorded calls."""
    rig.sleep.release()
    rig.stack.faults.clear()
    rig.stack.call_log.clear()
    rig.gateway.reset()


# --------------------------------------------------------------------------- reading


def kinds(responses: Iterable[chat_pb2.ChatResponse]) -> list[str]:
    """The event names of responses, in order."""
    return [str(r.WhichOneof("event")) for r in responses]


def events(responses: Iterable[chat_pb2.ChatResponse], kind: str) -> list[chat_pb2.ChatResponse]:
    return [r for r in responses if r.WhichOneof("event") == kind]


def stored_events(responses: Iterable[chat_pb2.ChatResponse]) -> list[chat_pb2.ChatResponse]:
    """The session events among responses (sequence > 0)."""
    return [r for r in responses if r.sequence > 0]


def event_message(response: chat_pb2.ChatResponse) -> resources_pb2.Message | None:
    """The transcript message a session event stored, if any."""
    kind = response.WhichOneof("event")
    if kind in ("message_accepted", "assistant_message", "tool_call_started", "tool_call_finished"):
        message: resources_pb2.Message = getattr(response, kind).message
        return message
    if kind == "compacted":
        return response.compacted.message
    return None


def tool_results(request: Any) -> list[Any]:
    """The tool results of a model request, in order."""
    return [m.tool_result for m in request.messages if m.role == gateway_pb2.ROLE_TOOL]


def error_reason(content: str) -> str:
    """The reason of an error result's JSON."""
    reason: str = json.loads(content)["error"]["reason"]
    return reason


async def eventually(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Poll ``check`` until true, in a bounded loop; for conditions without an event
    (a count of asyncio tasks, a pool's checked-out connections)."""
    deadline = time.monotonic() + WAIT_S
    delay = 0.005
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(0.1, delay * 2)


async def wait_for(awaitable: Awaitable[T]) -> T:
    """Await with the rig's bound."""
    async with asyncio.timeout(WAIT_S):
        return await awaitable
