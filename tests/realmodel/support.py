"""A real llama.cpp server for tests, and the planner wired to it through the devstack.

``llama_build()`` finds the build and models that ``scripts/llama-server`` caches (it asks
the script with ``--check``, which builds nothing): outside CI a missing build skips the
test and says how to make it; in CI (``CI`` truthy) or with
``BALLET_REQUIRE_LLAMA_SERVER=1`` (set by .ci/run) it fails instead.

``LlamaServer`` runs one ``llama-server`` process on loopback port 0 and reads the port
it bound from its log ("listening on http://127.0.0.1:PORT", written once the model is
loaded), so no port is picked and closed beforehand. Sampling is pinned on the server's
command line (temperature 0, top-k 1, a fixed seed: the defaults of every request), so a
small model answers the same prompt the same way. ``restart()`` brings a killed server
back on the port it had, as a local server restarting would.

``start_real_planner`` is the path ``ballet-planner dev --provider openai`` takes: a
``DevStack`` (demo project) whose LLM gateway serves the ``openai`` provider pointed at
the server, and a planner on SQLite whose dependencies are all the devstack, as in
tests/conformance/test_planner_conformance.py.

Nothing here sleeps to wait: the log is read line by line as the server writes it, and
chat responses are awaited with a bound (``REAL_WAIT_S``) that only turns a hang into a
failure.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc, resources_pb2
from ballet.planner.v1 import planner_service_pb2 as pb

from ballet_common.tokens import Trust, dev_secret, mint_dev_token
from devstack.gateway import GatewayServicer, add_gateway_service
from devstack.gateway.openai_provider import OpenAIProvider
from devstack.server import DevStack, DevStackConfig
from service.server.root import PlannerApp, start_planner
from tests.service.planner_support import auth, planner_settings
from tests.service.turn_support import ChatStream, events

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "llama-server"
REQUIRE_VARIABLE = "BALLET_REQUIRE_LLAMA_SERVER"
#: The longest any one wait for the real server may take, in seconds: a fresh prompt of
#: several thousand tokens takes a 2-core CPU tens of seconds. It only turns a hang into a
#: failure; passing tests never wait this long.
REAL_WAIT_S = 240.0
#: The context of the server (SmolLM2-135M was trained on 8 K).
CONTEXT_TOKENS = 8192
#: The model name the planner asks for; a single-model llama-server answers any name.
MODEL_NAME = "smollm2-135m-instruct"
#: Extra sampling for a server whose summaries must end: llama.cpp's repeat penalty at
#: 1.3 (llama-server's default is 1.0, off; Ollama's 1.1, with which this model's
#: summary of the test's session was refused as no shorter than what it replaced). With
#: greedy sampling alone SmolLM2-135M never ends a compaction answer on its own: it
#: repeats a line until the output cap, and an answer cut at its cap is refused
#: (``finish_length``). Still pinned (temperature 0, top-k 1, seed 42): the penalty only
#: lowers the scores of the last 64 tokens before the one best token is taken, so a fresh
#: server answers the same session the same way.
ENDING_SAMPLING = ("--repeat-penalty", "1.3")
_LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class LlamaBuild:
    """Paths of the cached build (``scripts/llama-server``'s ``NAME=value`` lines)."""

    server: Path
    model: Path
    template_tools: Path
    values: dict[str, str]


def llama_required() -> bool:
    """Whether a missing build fails the tests instead of skipping them: in CI (``CI``
    truthy) or with ``BALLET_REQUIRE_LLAMA_SERVER=1`` (.ci/run)."""
    return any(
        os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on")
        for flag in ("CI", REQUIRE_VARIABLE)
    )


class BuildMissing(Exception):
    """The build or a model is absent; the message names what and the command that builds it."""


def find_build() -> LlamaBuild:
    """The cached llama-server build and models, as ``scripts/llama-server --check`` reports
    them (it builds nothing).

    Raises:
        BuildMissing: something is absent.
    """
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise BuildMissing(
            f"no llama-server build ({result.stderr.strip()}); build it with "
            "scripts/llama-server (several minutes once, cached outside the checkout)"
        )
    values = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return LlamaBuild(
        server=Path(values["LLAMA_SERVER"]),
        model=Path(values["LLAMA_MODEL"]),
        template_tools=Path(values["LLAMA_TEMPLATE_TOOLS"]),
        values=values,
    )


def llama_build() -> LlamaBuild:
    """``find_build()`` for a test: skips when the build is absent, fails instead in CI."""
    try:
        return find_build()
    except BuildMissing as exc:
        message = str(exc)
    if llama_required():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@dataclass
class LlamaServer:
    """One ``llama-server`` on loopback (see the module docstring).

    Args:
        build: the cached build.
        log_path: where the server's output is appended (every start).
        template: the chat template file; None uses the model's own template.
        extra: more command-line arguments.
    """

    build: LlamaBuild
    log_path: Path
    template: Path | None = None
    extra: Sequence[str] = ()
    port: int = 0
    process: asyncio.subprocess.Process | None = None
    _pump: asyncio.Task[None] | None = None
    _lines: list[bytes] = field(default_factory=list)
    _waiters: list[tuple[re.Pattern[str], asyncio.Future[str]]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def args(self, port: int) -> list[str]:
        template = ["--chat-template-file", str(self.template)] if self.template else []
        return [
            str(self.build.server),
            "--model", str(self.build.model),
            "--jinja", *template,
            "--ctx-size", str(CONTEXT_TOKENS),
            "--parallel", "1",
            "--threads", "1",
            "--temp", "0", "--top-k", "1", "--seed", "42",
            "--host", "127.0.0.1", "--port", str(port),
            *self.extra,
        ]  # fmt: skip

    async def start(self, port: int = 0) -> None:
        """Start the server (on ``port``, 0 for any) and wait until it listens.

        Raises:
            RuntimeError: the server exited first (its log's last lines say why).
        """
        self.process = await asyncio.create_subprocess_exec(
            *self.args(port), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        listening: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pump = asyncio.create_task(self._read(self.process, listening))
        async with asyncio.timeout(REAL_WAIT_S):
            self.port = await listening

    async def _read(
        self, process: asyncio.subprocess.Process, listening: asyncio.Future[int]
    ) -> None:
        assert process.stdout is not None
        with self.log_path.open("ab") as log:
            while line := await process.stdout.readline():
                log.write(line)
                log.flush()
                self._lines.append(line)
                self._wake(line.decode(errors="replace"))
                found = _LISTENING.search(line)
                if found and not listening.done():
                    listening.set_result(int(found.group(1)))
        await process.wait()
        if not listening.done():
            tail = b"".join(self._lines[-20:]).decode(errors="replace")
            listening.set_exception(
                RuntimeError(f"llama-server exited with {process.returncode}:\n{tail}")
            )

    def _wake(self, line: str) -> None:
        for pattern, waiter in list(self._waiters):
            if not waiter.done() and pattern.search(line):
                waiter.set_result(line)
                self._waiters.remove((pattern, waiter))

    async def logged(self, pattern: str, *, since: int = 0) -> str:
        """The first line of the server's output from line ``since`` on that matches
        ``pattern`` (a regular expression), waiting for it if need be."""
        compiled = re.compile(pattern)
        for line in self._lines[since:]:
            text = line.decode(errors="replace")
            if compiled.search(text):
                return text
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.append((compiled, waiter))
        async with asyncio.timeout(REAL_WAIT_S):
            return await waiter

    @property
    def lines(self) -> int:
        """How many lines the server wrote so far (a mark for ``logged``'s ``since``)."""
        return len(self._lines)

    def output(self) -> str:
        """Everything the server wrote so far."""
        return b"".join(self._lines).decode(errors="replace")

    async def kill(self) -> None:
        """SIGKILL the server and wait for it (a crash, as the planner sees it)."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._pump is not None:
            await self._pump

    async def restart(self) -> None:
        """Start the server again on the port it had."""
        await self.start(self.port)

    async def stop(self) -> None:
        """Stop the server (SIGTERM) and wait for it."""
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                async with asyncio.timeout(30):
                    await self.process.wait()
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._pump is not None:
            await self._pump


class RealChatStream(ChatStream):
    """``ChatStream`` whose reads wait as long as a real model on a small CPU needs."""

    wait_s = REAL_WAIT_S

    async def send_and_start(self, text: str) -> str:
        """Send ``text``; returns the id of the turn it started (from its acceptance, so
        events the open replayed from earlier turns are not taken for this one's)."""
        request_id = f"send-{time.monotonic_ns()}"
        await self.send(text, request_id)
        accepted = await self.until(
            lambda r: r.WhichOneof("event") == "message_accepted" and r.request_id == request_id
        )
        return accepted[-1].turn_id

    async def finish(self, turn_id: str) -> chat_pb2.TurnEnded:
        """Read until turn ``turn_id`` ends."""
        ended = await self.until(
            lambda r: r.WhichOneof("event") == "turn_ended" and r.turn_id == turn_id
        )
        return ended[-1].turn_ended

    async def send_and_finish(self, text: str) -> chat_pb2.TurnEnded:
        return await self.finish(await self.send_and_start(text))


@dataclass
class Turn:
    """What one turn streamed, and how to read what it stored."""

    planner: RealPlanner
    session_id: str
    received: list[chat_pb2.ChatResponse]
    seconds: float

    @property
    def ended(self) -> chat_pb2.TurnEnded:
        return events(self.received, "turn_ended")[-1].turn_ended

    @property
    def turn_id(self) -> str:
        return str(events(self.received, "turn_ended")[-1].turn_id)

    @property
    def streamed_text(self) -> str:
        return "".join(r.text_delta.text for r in events(self.received, "text_delta"))

    async def transcript(self) -> list[resources_pb2.Message]:
        return await self.planner.transcript(self.session_id)


@dataclass
class RealPlanner:
    """A planner whose gateway's ``openai`` provider talks to ``server``; ``gateway`` is
    the devstack gateway's servicer (its ``requests``: every ``GenerateRequest`` it
    received, retried attempts included)."""

    server: LlamaServer
    stack: DevStack
    gateway: GatewayServicer
    app: PlannerApp
    channel: grpc.aio.Channel
    stub: Any
    data_dir: Path

    def meta(self) -> tuple[tuple[str, str], ...]:
        return auth(mint_dev_token(self.stack.dev_secret, "alice"))

    async def create_session(self) -> str:
        created = await self.stub.CreateSession(
            pb.CreateSessionRequest(request_id=f"create-{time.monotonic_ns()}", project_id="demo"),
            metadata=self.meta(),
        )
        return str(created.session.session_id)

    @asynccontextmanager
    async def chat(self, session_id: str) -> AsyncIterator[RealChatStream]:
        """An opened Chat stream on ``session_id``."""
        stream = RealChatStream(self.stub.Chat(metadata=self.meta()))
        try:
            await stream.open(session_id)
            await stream.opened()
            yield stream
        finally:
            stream.close()

    async def turn(self, text: str, session_id: str = "") -> Turn:
        """Send ``text`` (in a new session unless one is named) and read until the turn
        ends."""
        session_id = session_id or await self.create_session()
        started = time.monotonic()
        async with self.chat(session_id) as stream:
            await stream.send_and_finish(text)
        return Turn(self, session_id, stream.received, time.monotonic() - started)

    async def session(self, session_id: str) -> resources_pb2.Session:
        """The session as ``GetSession`` returns it (its summary included)."""
        got: pb.GetSessionResponse = await self.stub.GetSession(
            pb.GetSessionRequest(session_id=session_id), metadata=self.meta()
        )
        return got.session

    def early_model_calls(self) -> dict[str, float]:
        """``ballet_planner_early_model_calls_total`` by outcome, so far (decisions 0380
        and 0391)."""
        return self._counted("ballet_planner_early_model_calls", "outcome")

    def compaction_failures(self) -> dict[str, float]:
        """``ballet_planner_compaction_failures_total`` by reason, so far."""
        return self._counted("ballet_planner_compaction_failures", "reason")

    def _counted(self, counter: str, label: str) -> dict[str, float]:
        """The ``counter``'s ``_total`` samples by ``label``, so far."""
        return {
            sample.labels.get(label, ""): sample.value
            for metric in self.app.metrics.registry.collect()
            if metric.name == counter
            for sample in metric.samples
            if sample.name.endswith("_total")
        }

    async def transcript(self, session_id: str) -> list[resources_pb2.Message]:
        page = await self.stub.ListMessages(
            pb.ListMessagesRequest(session_id=session_id, page_size=1000), metadata=self.meta()
        )
        return list(page.messages)


#: The provider's settings: the project block goes into the first system message, where a
#: small model takes it for context rather than for the text to continue.
PROVIDER_OPTIONS: dict[str, Any] = {"system_context": "merged"}

#: Planner settings that fit the server's 8 K window (the start-up budget check holds).
BASE_SETTINGS = {
    "PLANNER__MODEL": MODEL_NAME,
    "PLANNER__MODEL_CONTEXT_TOKENS": str(CONTEXT_TOKENS),
    "PLANNER__COMPACT_AT_TOKENS": "3000",
    # Small answers keep the cases quick on a 2-core CPU; the cap is what stops a runaway.
    "PLANNER__MAX_OUTPUT_TOKENS": "48",
    "PLANNER__MAX_ROUNDS": "2",
    "PLANNER__TOOL_RESULT_MAX_BYTES": "1024",
    "PLANNER__COMPACTION_INPUT_MAX_TOKENS": "2048",
    "DEPENDENCIES__MODEL_FIRST_DELTA_S": str(REAL_WAIT_S),
    "DEPENDENCIES__MODEL_TOTAL_S": str(REAL_WAIT_S),
}


@asynccontextmanager
async def start_real_planner(
    server: LlamaServer,
    data_dir: Path,
    *,
    provider_options: dict[str, Any] | None = None,
    **settings: str,
) -> AsyncIterator[RealPlanner]:
    """The devstack (gateway over the ``openai`` provider at ``server``, with
    ``PROVIDER_OPTIONS`` updated by ``provider_options``) and a planner with
    ``BASE_SETTINGS`` updated by ``settings`` (``planner_settings`` keys)."""
    provider = OpenAIProvider(
        base_url=server.base_url,
        api_key="",
        model=MODEL_NAME,
        **{**PROVIDER_OPTIONS, **(provider_options or {})},
    )
    trust = Trust.dev(dev_secret(data_dir))
    gateways: list[GatewayServicer] = []
    stack = await DevStack.start(
        DevStackConfig(
            data_dir=data_dir,
            address="127.0.0.1:0",
            extra_services=lambda grpc_server: gateways.append(
                add_gateway_service(grpc_server, provider, trust=trust)
            ),
        )
    )
    app = await start_planner(
        planner_settings(data_dir, stack.address, **{**BASE_SETTINGS, **settings})
    )
    channel = grpc.aio.insecure_channel(app.address)
    try:
        yield RealPlanner(
            server,
            stack,
            gateways[0],
            app,
            channel,
            planner_service_pb2_grpc.PlannerServiceStub(channel),
            data_dir,
        )
    finally:
        await channel.close()
        await app.stop(0)
        await stack.stop(0)
        await provider.aclose()
