"""The rig of the hardening tests: devstack + scripted gateway + planners.

``start_stack`` starts, on loopback port 0, a ``DevStack`` (tracker, skills, knowledge on
SQLite, the built-in demo project) that also serves the LLM gateway over a
``ScriptedProvider``; ``Stack.planner`` then starts planners (``start_planner``) on SQLite
or PostgreSQL whose dependencies are the devstack, in dev mode with the devstack's data
directory, so both verify the same dev tokens and the devstack trusts the planner's
service credential. Several planners with different replica ids on one PostgreSQL
database are several replicas.

``Chat`` wraps one Chat stream. Nothing waits on the wall clock: every read awaits the
next response, bounded by ``WAIT_S`` only to turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc
from ballet.planner.v1 import planner_service_pb2 as pb
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from ballet_common.tokens import Trust, dev_secret
from devstack.gateway import GatewayServicer, ScriptedProvider, add_gateway_service
from devstack.server import DevStack, DevStackConfig
from service.adapters.store import migrate
from service.server.root import PlannerApp, start_planner
from tests.ports import ready_file_async
from tests.service.planner_support import auth, planner_settings

#: The longest any single wait may take before the test fails (seconds); passing tests
#: never come near it.
WAIT_S = 15.0

Metadata = tuple[tuple[str, str], ...]
T = TypeVar("T")

#: A model that answers at once: a tool call when the human mentions "items", else text.
QUICK_RULES: list[dict[str, Any]] = [
    {
        "match": {"last_role": "human", "last_text_regex": "items"},
        "reply": {"tool_calls": [{"name": "list_items", "arguments": {}}]},
    },
    {"match": {"last_role": "tool"}, "reply": {"text": "Here they are."}},
    {"match": {"purpose": "compaction"}, "reply": {"text": "A summary."}},
    {"reply": {"text": "Hello from the scripted model.", "chunk_chars": 8}},
]


@dataclass
class Planner:
    """One running planner and a channel to it."""

    app: PlannerApp
    channel: grpc.aio.Channel
    stub: planner_service_pb2_grpc.PlannerServiceStub

    async def stop(self) -> None:
        await self.channel.close()
        await self.app.stop(0)


@dataclass
class Stack:
    """A devstack with the scripted gateway, and the planners started on it."""

    devstack: DevStack
    gateway: GatewayServicer
    provider: ScriptedProvider
    data_dir: Path
    database_url: str
    planners: list[Planner] = field(default_factory=list)

    def auth(self, user: str = "alice", **token: Any) -> Metadata:
        """Call metadata with a dev token of ``user`` (``ttl_s``, ``audiences``...)."""
        return auth(self.devstack.token(user, **token))

    async def planner(self, replica_id: str = "", **settings: str) -> Planner:
        """Start a planner; ``settings`` are ``TABLE__KEY`` overrides, e.g.
        ``LIMITS__STREAMS_PER_HUMAN="3"``."""
        if replica_id:
            settings["SERVER__REPLICA_ID"] = replica_id
        config = planner_settings(
            self.data_dir, self.devstack.address, self.database_url, **settings
        )
        app = await start_planner(config)
        channel = grpc.aio.insecure_channel(app.address)
        planner = Planner(app, channel, planner_service_pb2_grpc.PlannerServiceStub(channel))
        self.planners.append(planner)
        return planner

    async def stop(self) -> None:
        for planner in self.planners:
            await planner.stop()
        await self.devstack.stop()


async def start_stack(
    data_dir: Path,
    rules: list[dict[str, Any]] | None = None,
    database_url: str = "",
    **devstack_config: Any,
) -> Stack:
    """A devstack serving the gateway over ``rules`` (default ``QUICK_RULES``); planners
    started later use ``database_url`` (migrated here; empty: SQLite in ``data_dir``).
    ``devstack_config`` are more ``DevStackConfig`` fields (e.g. ``token_leeway_s``)."""
    provider = ScriptedProvider({"rules": rules or QUICK_RULES})
    trust = Trust.dev(dev_secret(data_dir))
    added: list[GatewayServicer] = []
    devstack = await DevStack.start(
        DevStackConfig(
            data_dir=data_dir,
            address="127.0.0.1:0",
            extra_services=lambda server: added.append(
                add_gateway_service(server, provider, trust=trust)
            ),
            **devstack_config,
        )
    )
    if database_url:
        await migrate(database_url)
    return Stack(devstack, added[0], provider, data_dir, database_url)


async def within(awaitable: Awaitable[T], seconds: float = WAIT_S) -> T:
    """Await ``awaitable``, failing the test after ``seconds`` (a hang, not a wait)."""
    return await asyncio.wait_for(awaitable, seconds)


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = WAIT_S) -> None:
    """Poll ``check`` until it holds (for state with no event to await), bounded."""
    deadline = time.monotonic() + seconds
    delay = 0.01
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {seconds} s")
        await asyncio.sleep(delay)
        delay = min(0.2, delay * 2)


def error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo of a google.rpc.Status (AIP-193)."""
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1, status
    return infos[0]


def retry_delay_s(status: status_pb2.Status) -> float | None:
    """The RetryInfo delay of a status in seconds, or None without one."""
    for detail in status.details:
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            return float(retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9)
    return None


def failure(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str, status_pb2.Status]:
    """A failed call's code, ErrorInfo reason and full status."""
    status = rpc_status.from_call(error)
    assert status is not None, f"{error.code()} without a google.rpc.Status: {error.details()}"
    return error.code(), error_info(status).reason, status


async def refused(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str, status_pb2.Status]:
    """Await a unary call that must fail; returns its code, reason and status."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return failure(error)
    raise AssertionError("the call succeeded")


def open_request(
    request_id: str = "", *, session_id: str = "", after_sequence: int = 0, **create: str
) -> chat_pb2.ChatRequest:
    """An ``open`` of ``session_id``, or of a new session (``project_id``, ``title``)."""
    return chat_pb2.ChatRequest(
        request_id=request_id,
        open=chat_pb2.OpenAction(session_id=session_id, after_sequence=after_sequence, **create),
    )


def send_request(text: str, request_id: str) -> chat_pb2.ChatRequest:
    return chat_pb2.ChatRequest(
        request_id=request_id, send_message=chat_pb2.SendMessageAction(text=text)
    )


def cancel_request(turn_id: str = "", request_id: str = "") -> chat_pb2.ChatRequest:
    return chat_pb2.ChatRequest(
        request_id=request_id, cancel_turn=chat_pb2.CancelTurnAction(turn_id=turn_id)
    )


class Chat:
    """One Chat stream: write requests, read responses with a bound, see how it ended."""

    def __init__(self, stub: planner_service_pb2_grpc.PlannerServiceStub, metadata: Metadata):
        self.call: Any = stub.Chat(metadata=metadata)
        self.session_id = ""

    async def send(self, request: chat_pb2.ChatRequest) -> None:
        await within(self.call.write(request))

    async def read(self) -> chat_pb2.ChatResponse:
        """The next response; AssertionError when the stream ended instead."""
        response = await within(self.call.read())
        if response is grpc.aio.EOF:
            raise AssertionError(f"the stream ended: {await self.call.code()}")
        assert isinstance(response, chat_pb2.ChatResponse)
        return response

    async def until(self, event: str, **match: Any) -> chat_pb2.ChatResponse:
        """Read until a response whose event is ``event`` (and whose fields equal
        ``match``); an ``error`` reply on the way fails, unless ``event`` is error."""
        while True:
            response = await self.read()
            kind = response.WhichOneof("event")
            if kind == "error" and event != "error":
                info = error_info(response.error)
                raise AssertionError(f"error reply {info.reason}: {response.error.message}")
            if kind == event and all(getattr(response, k) == v for k, v in match.items()):
                return response

    async def open(self, request_id: str = "", **kw: Any) -> chat_pb2.ChatResponse:
        """Open (a new session in project ``demo`` unless ``session_id`` is given)."""
        if "session_id" not in kw:
            kw.setdefault("project_id", "demo")
        await self.send(open_request(request_id, **kw))
        opened = await self.until("session_opened")
        self.session_id = opened.session_id
        return opened

    async def turn(self, text: str, request_id: str) -> chat_pb2.ChatResponse:
        """Send a message and read until its turn ends; returns the turn_ended event."""
        await self.send(send_request(text, request_id))
        accepted = await self.until("message_accepted")
        return await self.until("turn_ended", turn_id=accepted.turn_id)

    async def ended(self) -> grpc.aio.AioRpcError | None:
        """Read to the end of the stream; returns its error, or None when it ended OK."""
        while True:
            try:
                response = await within(self.call.read())
            except grpc.aio.AioRpcError as error:
                return error
            if response is grpc.aio.EOF:
                break
        code = await within(self.call.code())
        if code == grpc.StatusCode.OK:
            return None
        raise AssertionError(f"ended {code} without raising")

    async def close(self) -> None:
        """Half-close and read to the end (the server then ends the stream)."""
        await within(self.call.done_writing())
        await self.ended()

    def cancel(self) -> None:
        self.call.cancel()


async def create_session(planner: Planner, metadata: Metadata, request_id: str) -> str:
    """CreateSession in project ``demo``; returns the session id."""
    response = await planner.stub.CreateSession(
        pb.CreateSessionRequest(request_id=request_id, project_id="demo", title="t"),
        metadata=metadata,
    )
    return str(response.session.session_id)


# --------------------------------------------------------------------------- processes


def planner_command() -> list[str]:
    """``ballet-planner`` of this environment."""
    script = Path(sys.executable).with_name("ballet-planner")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


@dataclass
class PlannerProcess:
    """A ``ballet-planner serve`` subprocess started on port 0; ``address`` and
    ``metrics_address`` are the loopback ``host:port`` it bound, read from its
    ``--ready-file`` (``ready_path``) by ``_wait_serving``; its output goes to
    ``log_path``."""

    process: subprocess.Popen[bytes]
    address: str
    metrics_address: str
    log_path: Path
    ready_path: Path | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGKILL, if still running, and reap."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


async def serve_process(stack: Stack, log_path: Path, **settings: str) -> PlannerProcess:
    """Start ``ballet-planner serve`` on the stack (its devstack, data dir and database)
    with ``TABLE__KEY`` overrides, and wait until health says SERVING."""
    served = spawn_process(stack, log_path, **settings)
    try:
        await _wait_serving(served)
    except BaseException:
        served.stop()
        raise
    return served


def spawn_process(stack: Stack, log_path: Path, **settings: str) -> PlannerProcess:
    """Start ``ballet-planner serve`` (see ``serve_process``) without waiting: its
    addresses are known once ``_wait_serving`` read its ready file."""
    ready_path = log_path.with_name(log_path.name + ".ready.json")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BALLET_PLANNER__")}
    env.update(
        {
            "BALLET_PLANNER__DATA_DIR": str(stack.data_dir),
            "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__DATABASE__URL": stack.database_url,
            "BALLET_PLANNER__LOGGING__LEVEL": "WARNING",
        }
    )
    for name in ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY"):
        env[f"BALLET_PLANNER__DEPENDENCIES__{name}__ADDRESS"] = stack.devstack.address
    env.update({f"BALLET_PLANNER__{key.upper()}": value for key, value in settings.items()})
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*planner_command(), "serve", "--ready-file", str(ready_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return PlannerProcess(process, "", "", log_path, ready_path)


async def _wait_serving(served: PlannerProcess, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    if served.ready_path is not None and not served.address:
        bound = await ready_file_async(served.ready_path, served.process, limit_s, served.log_path)
        served.address, served.metrics_address = bound["address"], bound["metrics_address"]
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if served.process.poll() is not None:
                raise AssertionError(
                    f"serve exited with {served.process.returncode}:\n{served.log()}"
                )
            try:
                response = await stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True
                )
            except grpc.aio.AioRpcError:
                continue
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
    raise AssertionError(f"not SERVING within {limit_s} s:\n{served.log()}")
