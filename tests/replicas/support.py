"""Two planner processes on one PostgreSQL, the devstack beside them (docs/spec/api-and-streams.md:
"tests of the one-running-turn rule, fan-out, cancel and reopen run two planner processes on one
PostgreSQL").

``rig`` (an async context manager) starts, in the test's event loop, one ``DevStack``
(tracker, skills, knowledge and the scripted LLM gateway, on SQLite in the shared data
directory), runs ``ballet-planner migrate`` once, then two real ``ballet-planner serve
--config FILE`` subprocesses (replicas ``replica-a`` and ``replica-b``) on their own
loopback ports. All three share one data directory, so the planners' dev secret is the
devstack's and one dev token works everywhere.

``ChatStream`` drives one ``Chat`` call: a reader task keeps every response with its
arrival time (``time.monotonic()``), and tests await what they expect with bounded waits.
Nothing here sleeps to wait for something.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from ballet.planner.v1 import chat_pb2, planner_service_pb2, planner_service_pb2_grpc
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballet_common.tokens import Trust, dev_secret
from devstack.gateway import GatewayServicer, ScriptedProvider, add_gateway_service
from devstack.server import DevStack, DevStackConfig
from tests.ports import ready_file_async

#: How long a planner process may take to report SERVING (a cold Python start is ~2 s).
START_LIMIT_S = 30.0

Metadata = tuple[tuple[str, str], ...]

SESSION_EVENTS = frozenset(
    {
        "message_accepted",
        "message_queued",
        "turn_started",
        "assistant_message",
        "tool_call_started",
        "tool_call_finished",
        "changeset_proposed",
        "knowledge_written",
        "compacted",
        "turn_ended",
    }
)
END = res.TurnEndReason


def planner_command() -> list[str]:
    """The ``ballet-planner`` entry point of this interpreter's environment."""
    script = Path(sys.executable).with_name("ballet-planner")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # A JSON string is a valid TOML basic string for the ASCII paths and URLs used here.
    return json.dumps(str(value))


def write_toml(path: Path, tables: Mapping[str, Mapping[str, object]], **top: object) -> None:
    """Write a flat TOML file: top-level keys, then one ``[table]`` per entry."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    for name, keys in tables.items():
        lines.append(f"\n[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in keys.items())
    path.write_text("\n".join(lines) + "\n")


def _clean_env() -> dict[str, str]:
    # The configuration file alone decides: no BALLET_PLANNER__ variable of the caller's.
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("BALLET_PLANNER__")}


@dataclass
class Planner:
    """One ``ballet-planner serve`` process (on port 0: ``address`` is the port it bound,
    read from its ready file) and a channel to it."""

    name: str
    replica_id: str
    address: str
    config: Path
    log: Path
    process: subprocess.Popen[bytes]
    channel: grpc.aio.Channel
    stub: Any
    health: Any
    ready: Path | None = None
    _rebind: bool = False

    @staticmethod
    def spawn(config: Path, log: Path, ready: Path) -> subprocess.Popen[bytes]:
        """Start ``ballet-planner serve --config config --ready-file ready``, appending its
        output to ``log``."""
        ready.unlink(missing_ok=True)  # a killed process leaves its file behind
        with log.open("ab") as out:
            return subprocess.Popen(
                [*planner_command(), "serve", "--config", str(config), "--ready-file", str(ready)],
                cwd=config.parent,
                env=_clean_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def respawn(self) -> None:
        """Start the process again with the same configuration (the same replica id)."""
        assert self.process.poll() is not None, "still running"
        assert self.ready is not None
        self.process = self.spawn(self.config, self.log, self.ready)
        # On port 0 again: wait_health reads the new port and reconnects.
        self._rebind = True

    async def _bind_channel(self) -> None:
        assert self.ready is not None
        bound = await ready_file_async(self.ready, self.process, START_LIMIT_S, self.log)
        await self.channel.close()
        self.address = bound["address"]
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = planner_service_pb2_grpc.PlannerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._rebind = False

    def log_text(self) -> str:
        """What the process wrote so far (JSON log lines)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def health_status(self, timeout_s: float = 1.0) -> int:
        """The overall health status (``HealthCheckResponse.ServingStatus``); raises
        ``grpc.aio.AioRpcError`` when the process does not answer."""
        response = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        status: int = response.status
        return status

    async def wait_health(self, wanted: int, limit_s: float = START_LIMIT_S) -> float:
        """Poll health (bounded: there is no event to await across processes) until it
        reports ``wanted``; returns the seconds it took. Fails with the log on timeout or
        when the process exits."""
        started = time.monotonic()
        if self._rebind:
            await self._bind_channel()
        while time.monotonic() - started < limit_s:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log_text()}"
                )
            with contextlib.suppress(grpc.aio.AioRpcError):
                if await self.health_status() == wanted:
                    return time.monotonic() - started
            await asyncio.sleep(0.05)
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(wanted)
        raise AssertionError(
            f"{self.name} did not report {name} within {limit_s} s:\n{self.log_text()}"
        )

    def freeze(self) -> None:
        """SIGSTOP: the process stops where it is (no lease renewal, no commit), holding
        its sockets open; ``kill`` still works."""
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, storing nothing more."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    async def close(self) -> None:
        """Close the channel; SIGTERM the process (SIGKILL after its grace)."""
        await self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.kill()

    # ----------------------------------------------------------------- unary helpers

    async def get_turn(self, meta: Metadata, session_id: str, turn_id: str) -> res.Turn:
        response = await self.stub.GetTurn(
            planner_service_pb2.GetTurnRequest(session_id=session_id, turn_id=turn_id),
            metadata=meta,
            timeout=5,
        )
        turn: res.Turn = response.turn
        return turn

    async def wait_turn_ended(
        self, meta: Metadata, session_id: str, turn_id: str, limit_s: float
    ) -> res.Turn:
        """Poll ``GetTurn`` (bounded) until the turn has ended; fails after ``limit_s``."""
        started = time.monotonic()
        while True:
            turn = await self.get_turn(meta, session_id, turn_id)
            if turn.state == res.TURN_STATE_ENDED:
                return turn
            if time.monotonic() - started > limit_s:
                raise AssertionError(f"turn {turn_id} still running after {limit_s} s: {turn}")
            await asyncio.sleep(0.05)

    async def messages(self, meta: Metadata, session_id: str) -> list[res.Message]:
        """The whole transcript, every page."""
        out: list[res.Message] = []
        token = ""
        while True:
            page = await self.stub.ListMessages(
                planner_service_pb2.ListMessagesRequest(
                    session_id=session_id, page_size=1000, page_token=token
                ),
                metadata=meta,
                timeout=10,
            )
            out.extend(page.messages)
            token = page.next_page_token
            if not token:
                return out

    async def send_message(
        self,
        meta: Metadata,
        session_id: str,
        text: str,
        request_id: str,
        timeout_s: float = 30,
        on_busy: res.OnBusy.ValueType = 0,
    ) -> planner_service_pb2.SendMessageResponse:
        """Unary ``SendMessage``: the whole turn, or at once for a queued message
        (raises ``grpc.aio.AioRpcError``)."""
        response: planner_service_pb2.SendMessageResponse = await self.stub.SendMessage(
            planner_service_pb2.SendMessageRequest(
                session_id=session_id, text=text, request_id=request_id, on_busy=on_busy
            ),
            metadata=meta,
            timeout=timeout_s,
        )
        return response

    async def create_session(self, meta: Metadata, request_id: str, title: str = "") -> str:
        response = await self.stub.CreateSession(
            planner_service_pb2.CreateSessionRequest(
                request_id=request_id, project_id="demo", title=title
            ),
            metadata=meta,
            timeout=10,
        )
        session_id: str = response.session.session_id
        return session_id


@dataclass
class Rig:
    """The devstack, the scripted model and two planner processes on one database."""

    stack: DevStack
    provider: ScriptedProvider
    gateway: GatewayServicer
    data_dir: Path
    database_url: str
    a: Planner
    b: Planner
    alice: Metadata


async def start_planner_process(
    name: str,
    work_dir: Path,
    data_dir: Path,
    database_url: str,
    stack_address: str,
    planner: Mapping[str, object],
    limits: Mapping[str, object],
    server: Mapping[str, object],
    more_tables: Mapping[str, Mapping[str, object]] | None = None,
    database: Mapping[str, object] | None = None,
) -> Planner:
    """Write ``<name>.toml`` and start ``ballet-planner serve --config`` with it (not
    waiting for it to serve, only for the port it bound); ``more_tables`` are further
    tables, e.g. ``retention``."""
    replica_id = f"replica-{name}"
    config = work_dir / f"{name}.toml"
    tables: dict[str, Mapping[str, object]] = {
        "server": {
            "address": "127.0.0.1:0",
            "metrics_address": "",
            "replica_id": replica_id,
            # At least planner.cancel_grace (5 s by default) + 2 (decision 0181).
            "grace_s": 7.0,
            "health_check_interval_s": 0.2,
            **server,
        },
        "database": {"url": database_url, "pool_size": 5, **(database or {})},
        "planner": {"model": "scripted", **planner},
        "limits": dict(limits),
        "logging": {"level": "INFO", "format": "json"},
    }
    for dependency in ("tracker", "skills", "knowledge", "gateway"):
        tables[f"dependencies.{dependency}"] = {"address": stack_address}
    tables.update(more_tables or {})
    write_toml(config, tables, data_dir=str(data_dir))
    log = work_dir / f"{name}.log"
    ready = work_dir / f"{name}.ready.json"
    process = Planner.spawn(config, log, ready)
    try:
        bound = await ready_file_async(ready, process, START_LIMIT_S, log)
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    address = bound["address"]
    channel = grpc.aio.insecure_channel(address)
    return Planner(
        name=name,
        replica_id=replica_id,
        address=address,
        config=config,
        log=log,
        process=process,
        channel=channel,
        stub=planner_service_pb2_grpc.PlannerServiceStub(channel),
        health=health_pb2_grpc.HealthStub(channel),
        ready=ready,
    )


async def migrate_with_cli(work_dir: Path, database_url: str) -> None:
    """``ballet-planner migrate`` as the job a deployment runs before the replicas."""
    process = await asyncio.create_subprocess_exec(
        *planner_command(),
        "migrate",
        "--database-url",
        database_url,
        cwd=work_dir,
        env=_clean_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode(errors="replace")


@contextlib.asynccontextmanager
async def rig(
    work_dir: Path,
    database_url: str,
    scenario: object,
    *,
    planner: Mapping[str, object] | None = None,
    limits: Mapping[str, object] | None = None,
    server: Mapping[str, object] | None = None,
    more_tables: Mapping[str, Mapping[str, object]] | None = None,
    database: Mapping[str, object] | None = None,
    b_database_url: str | None = None,
) -> AsyncIterator[Rig]:
    """Start the devstack, migrate, start both planners and wait until both serve.

    ``planner``, ``limits``, ``server`` and ``database`` are extra keys of those tables,
    the same for both processes (leases and sweeps small, so recovery tests stay fast);
    ``more_tables`` are further tables for both (e.g. ``retention``). ``b_database_url``
    is B's own way to the same database (another address of it, so that a fault can cut
    one replica only); A uses ``database_url``.
    """
    data_dir = work_dir / "data"
    provider = ScriptedProvider(scenario)  # type: ignore[arg-type]
    servicers: list[GatewayServicer] = []
    migration = asyncio.create_task(migrate_with_cli(work_dir, database_url))
    stack = await DevStack.start(
        DevStackConfig(
            data_dir=data_dir,
            address="127.0.0.1:0",
            extra_services=lambda s: servicers.append(
                add_gateway_service(s, provider, trust=Trust.dev(dev_secret(data_dir)))
            ),
        )
    )
    planners: list[Planner] = []
    try:
        await migration
        # Both start at once: each is awaited only for the port it bound.
        started = await asyncio.gather(
            *(
                start_planner_process(
                    name,
                    work_dir,
                    data_dir,
                    b_database_url if name == "b" and b_database_url else database_url,
                    stack.address,
                    planner or {},
                    limits or {},
                    server or {},
                    more_tables,
                    database,
                )
                for name in ("a", "b")
            ),
            return_exceptions=True,
        )
        planners.extend(each for each in started if isinstance(each, Planner))
        for each in started:
            if isinstance(each, BaseException):
                raise each
        await asyncio.gather(
            *(p.wait_health(health_pb2.HealthCheckResponse.SERVING) for p in planners)
        )
        built = Rig(
            stack=stack,
            provider=provider,
            gateway=servicers[0],
            data_dir=data_dir,
            database_url=database_url,
            a=planners[0],
            b=planners[1],
            alice=(("authorization", f"Bearer {stack.token('alice')}"),),
        )
        yield built
    finally:
        stack.faults.clear()
        await asyncio.gather(*(p.close() for p in planners), return_exceptions=True)
        await stack.stop(0)


# --------------------------------------------------------------------------- Chat


@dataclass
class Received:
    """One ``ChatResponse`` and when it arrived: ``at`` is ``time.monotonic()``, ``wall``
    is ``time.time()`` (to compare with the stored ``create_time`` of a message)."""

    at: float
    wall: float
    response: chat_pb2.ChatResponse

    @property
    def kind(self) -> str:
        return self.response.WhichOneof("event") or ""


@dataclass
class ChatStream:
    """One Chat call: ``send`` client messages; a reader task collects every response.

    ``ended`` is set when the call finishes; ``error`` then holds its failure (None: OK).
    """

    call: Any
    requests: asyncio.Queue[chat_pb2.ChatRequest | None]
    received: list[Received] = field(default_factory=list)
    error: grpc.aio.AioRpcError | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    def open(cls, planner: Planner, meta: Metadata) -> ChatStream:
        queue: asyncio.Queue[chat_pb2.ChatRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[chat_pb2.ChatRequest]:
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        stream = cls(call=planner.stub.Chat(requests(), metadata=meta), requests=queue)
        stream._reader = asyncio.get_running_loop().create_task(stream._read())
        return stream

    async def _read(self) -> None:
        try:
            async for response in self.call:
                self.received.append(Received(time.monotonic(), time.time(), response))
                async with self._changed:
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as error:
            self.error = error
        finally:
            self.ended.set()
            async with self._changed:
                self._changed.notify_all()

    def send(self, request: chat_pb2.ChatRequest) -> None:
        self.requests.put_nowait(request)

    def attach(self, session_id: str, after_sequence: int = 0, request_id: str = "") -> None:
        self.send(
            chat_pb2.ChatRequest(
                request_id=request_id,
                open=chat_pb2.OpenAction(session_id=session_id, after_sequence=after_sequence),
            )
        )

    def say(self, text: str, request_id: str, on_busy: res.OnBusy.ValueType = 0) -> None:
        """Send ``text``; ``on_busy`` says what to do while a turn runs (decision 0300)."""
        self.send(
            chat_pb2.ChatRequest(
                request_id=request_id,
                send_message=chat_pb2.SendMessageAction(text=text, on_busy=on_busy),
            )
        )

    def cancel(self, turn_id: str = "", request_id: str = "") -> None:
        self.send(
            chat_pb2.ChatRequest(
                request_id=request_id, cancel_turn=chat_pb2.CancelTurnAction(turn_id=turn_id)
            )
        )

    async def wait_for(
        self, predicate: Callable[[list[Received]], bool], timeout_s: float = 10.0
    ) -> list[Received]:
        """Wait until ``predicate(received)`` holds (or the call ended: then it must hold)."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(self.received) or self.ended.is_set())
        if not predicate(self.received):
            raise AssertionError(
                f"the stream ended ({self.error!r}) before the wait was satisfied: "
                f"{[r.kind for r in self.received]}"
            )
        return self.received

    async def wait_kind(self, kind: str, timeout_s: float = 10.0, count: int = 1) -> Received:
        """The ``count``-th response of ``kind`` (waiting for it)."""
        await self.wait_for(lambda got: sum(r.kind == kind for r in got) >= count, timeout_s)
        return [r for r in self.received if r.kind == kind][count - 1]

    async def opened(self, timeout_s: float = 10.0) -> chat_pb2.ChatResponse:
        return (await self.wait_kind("session_opened", timeout_s)).response

    @classmethod
    async def opened_on(
        cls, planner: Planner, meta: Metadata, session_id: str, after_sequence: int = 0
    ) -> ChatStream:
        """A stream on ``planner`` attached to ``session_id`` after ``after_sequence``,
        once its open is answered (a gateway's reopen)."""
        stream = cls.open(planner, meta)
        stream.attach(session_id, after_sequence=after_sequence)
        await stream.opened()
        return stream

    async def accepted(self, text: str, request_id: str) -> str:
        """Send ``text``; the turn id its ``message_accepted`` names."""
        self.say(text, request_id)
        return str((await self.wait_kind("message_accepted")).response.turn_id)

    async def turn_ended(self, turn_id: str, timeout_s: float = 10.0) -> Received:
        await self.wait_for(
            lambda got: any(r.kind == "turn_ended" and r.response.turn_id == turn_id for r in got),
            timeout_s,
        )
        return next(
            r for r in self.received if r.kind == "turn_ended" and r.response.turn_id == turn_id
        )

    def events(self) -> list[Received]:
        """The session events received, in arrival order."""
        return [r for r in self.received if r.kind in SESSION_EVENTS]

    def errors(self) -> list[chat_pb2.ChatResponse]:
        return [r.response for r in self.received if r.kind == "error"]

    def half_close(self) -> None:
        """End the client's side: no more client messages (the server's side goes on)."""
        self.requests.put_nowait(None)

    async def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


def sequences(received: Iterable[Received]) -> list[int]:
    return [r.response.sequence for r in received if r.kind in SESSION_EVENTS]
