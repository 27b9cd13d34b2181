"""``ballet-planner dev``: the devstack and the planner together, on loopback, in one
process (README.md).

This module belongs to the devstack, not to the planner: the planner's CLI reaches it
through one lazy import (``service/cli.py``), so an image of the planner can leave the
devstack out. It uses only the planner's public entry points (``service.server.root``, the
settings of ``service.config``), never its internals.

``start_dev(options)`` starts, in this order:

1. the settings: ``--config FILE`` (its ``[planner]`` table and everything else) and the
   ``BALLET_PLANNER__`` environment, with dev overriding only the data directory, the
   planner's address (``--address``), the database (``--database-url``) and the four
   dependency channels (all the devstack's address, plaintext on loopback); with
   ``--provider openai`` also ``planner.model`` when ``BALLET_OPENAI_MODEL`` is set,
   with ``scripted`` the scripted model's name (``scripted demo``) unless one is set;
2. the model provider (``devstack.model.make_provider``): ``scripted`` over
   ``--scenario FILE`` (re-read when it changes) or the built-in demo scenario, or
   ``openai`` from the ``BALLET_OPENAI_*`` environment;
3. the devstack (``DevStack.start``): tracker, skills and knowledge backends with the
   organization ``acme``, users ``alice`` and ``bob``, the demo project or the imported
   beads export, the LLM gateway over the provider (``extra_services``);
4. the planner (``start_planner``) pointed at the devstack. On SQLite the planner and the
   devstack keep separate files in the data directory (``planner.db``,
   ``devstack.db``); with ``--database-url`` they share that PostgreSQL database (the
   devstack's tables are prefixed ``ds_``), and dev migrates the planner's schema itself
   (docs/decisions/0050-dev-command.md).

``run_dev(options)`` prints where everything listens and how to connect, then serves until
SIGINT or SIGTERM and shuts down within ``server.grace_s``: the planner first (its turns
end within that period), then the devstack, then the provider's connections. It says what
the stop waits for; a second Ctrl-C skips to the end (decision 0185).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc

from ballet_common import datadir
from ballet_common.readyfile import remove_ready_file, write_ready_file
from ballet_common.signals import StopSignals, stop_when_signalled
from ballet_common.signals import stopping_message as stopping_text
from ballet_common.tokens import DevSecretError, Trust, dev_secret
from ballet_common.tracing import Tracing, TracingConfigError, tracing_from_environment
from devstack.defaults import BUF_INSTALL, BUF_PROGRAM
from devstack.demo.project import GLOBEX_PROJECT_ID
from devstack.gateway import GatewayServicer, Provider, add_gateway_service
from devstack.importers.errors import ImportFileError
from devstack.model import (
    OPENAI_MODEL_VARIABLE,
    ProviderName,
    ProviderSetupError,
    make_provider,
    scripted_model_name,
)
from devstack.server import DEFAULT_ADDRESS as DEVSTACK_ADDRESS
from devstack.server import DevStack, DevStackConfig
from devstack.store.access import describe_users
from devstack.store.db import DatabaseUnreachable
from service.config import (
    ENV_PREFIX,
    ChannelSettings,
    ConfigError,
    PlannerSettings,
    Settings,
    load_settings,
    split_address,
)
from service.server.root import (
    EXIT_RESERVE_S,
    PlannerApp,
    migrate_database,
    planner_tracing,
    start_planner,
)

__all__ = [
    "DEPENDENCY_SERVICES",
    "OPENAI_MODEL_VARIABLE",
    "DevApp",
    "DevError",
    "DevOptions",
    "banner",
    "dev_settings",
    "run_dev",
    "start_dev",
]

#: The planner's default address (docs/spec/api-and-streams.md); ``chat`` connects there by default.
PLANNER_ADDRESS = "127.0.0.1:50051"
DEMO_PROJECT = "demo"
#: The devstack's dependency services, as reflection lists them.
DEPENDENCY_SERVICES = (
    "ballet.tracker.v1.TrackerService",
    "ballet.skills.v1.SkillsService",
    "ballet.knowledge.v1.KnowledgeService",
    "ballet.llm.v1.GatewayService",
)

log = logging.getLogger(__name__)


class DevError(RuntimeError):
    """``dev`` cannot start; the message says why and what to do."""


@dataclass(frozen=True)
class DevOptions:
    """The ``ballet-planner dev`` command line.

    - ``config_file``: a planner TOML file, applied whole (``[planner]`` included).
    - ``data_dir``: state of both halves (dev secret, SQLite files); None: the settings'
      ``data_dir`` (``BALLET_PLANNER__DATA_DIR``, the file's, else ``./.ballet-dev``).
    - ``database_url``: a PostgreSQL URL both halves use instead of SQLite.
    - ``tracker_file``, ``project_id``: a beads ``issues.jsonl`` imported as that project;
      without a file the built-in ``demo`` project is loaded.
    - ``knowledge_dir``, ``skills_dir``: ADR and skill folders to import.
    - ``provider``, ``scenario``: the model behind the LLM gateway.
    - ``address``: the planner's ``host:port`` (None: ``server.address`` of the
      settings, default ``127.0.0.1:50051``); ``devstack_address``: the devstack's. Port 0
      picks a free port. ``metrics_address``: the planner's metrics ``host:port`` (None:
      ``server.metrics_address``, default ``127.0.0.1:9464``; empty: off).
    - ``log_format``: ``text`` or ``json`` (None: ``logging.format`` of the settings).
    - ``ready_file``: once both serve, the bound addresses, the data directory and the
      project are written there as JSON (``ballet_common.readyfile``); removed at the stop.
    """

    config_file: Path | None = None
    data_dir: Path | None = None
    database_url: str | None = None
    tracker_file: Path | None = None
    project_id: str = DEMO_PROJECT
    knowledge_dir: Path | None = None
    skills_dir: Path | None = None
    provider: ProviderName = "scripted"
    scenario: Path | None = None
    address: str | None = None
    devstack_address: str = DEVSTACK_ADDRESS
    metrics_address: str | None = None
    log_format: str | None = None
    ready_file: Path | None = None

    @property
    def project(self) -> str:
        """The project a human chats about: the imported one, or ``demo``."""
        return self.project_id if self.tracker_file is not None else DEMO_PROJECT


#: The settings ``dev`` takes from its flags, by key.
_FLAGS = {
    "data_dir": "--data-dir",
    "server.address": "--address",
    "server.metrics_address": "--metrics-address",
    "logging.format": "--log-format",
    "database.url": "--database-url",
}


def dev_settings(options: DevOptions, environ: Mapping[str, str] | None = None) -> Settings:
    """The planner's settings for ``dev``: the file and the environment, with dev's
    overrides (see the module docstring). The dependency addresses are the devstack's
    requested address; ``start_dev`` replaces them with the bound one.

    Raises ``ConfigError`` naming the key (or the flag).
    """
    # Checked first: the devstack binds it, and the planner's dependencies dial it.
    split_address(options.devstack_address, "--devstack-address")
    env = dict(os.environ if environ is None else environ)
    overrides: dict[str, str] = {}
    if options.data_dir is not None:
        overrides["DATA_DIR"] = str(options.data_dir)
    if options.address is not None:
        overrides["SERVER__ADDRESS"] = options.address
    if options.metrics_address is not None:
        overrides["SERVER__METRICS_ADDRESS"] = options.metrics_address
    if options.log_format is not None:
        overrides["LOGGING__FORMAT"] = options.log_format
    if options.database_url is not None:
        overrides["DATABASE__URL"] = options.database_url
    for name in ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY"):
        overrides[f"DEPENDENCIES__{name}__ADDRESS"] = options.devstack_address
    if options.provider == "openai" and env.get(OPENAI_MODEL_VARIABLE):
        overrides["PLANNER__MODEL"] = env[OPENAI_MODEL_VARIABLE]
    env.update({f"{ENV_PREFIX}{key}": value for key, value in overrides.items()})
    try:
        settings = load_settings(options.config_file, env)
    except ConfigError as error:
        # A value given as a flag is named by its flag first: the key is not what was typed.
        given = {name.lower().replace("__", ".") for name in overrides}
        key, _, problem = str(error).partition(":")
        if key not in given or key not in _FLAGS:
            raise
        raise ConfigError(f"{_FLAGS[key]} ({key}):{problem}") from None
    if options.provider == "scripted" and settings.planner.model == PlannerSettings().model:
        # The scripted model answers whatever model is asked for: unless a model was
        # configured, asking for it by its name makes every turn (and the chat's model
        # line) name what answers.
        planner = dataclasses.replace(settings.planner, model=scripted_model_name(options.scenario))
        settings = dataclasses.replace(settings, planner=planner)
    return settings


@dataclass
class DevApp:
    """A running ``dev``: the devstack (with the gateway), the planner, and what was
    loaded. ``ready_s`` is the start-up time in seconds."""

    options: DevOptions
    settings: Settings
    stack: DevStack
    gateway: GatewayServicer
    planner: PlannerApp
    provider: Provider
    provider_description: str
    ready_s: float
    #: The devstack's tracing (the planner owns its own); None when off.
    tracing: Tracing | None = None

    _stopped: asyncio.Future[None] | None = None
    _deadline: float = 0.0
    _flushing: bool = False

    async def stop(self, grace: float | None = None) -> None:
        """Stop within ``grace`` seconds (default the planner's ``server.grace_s``): the
        planner (its turns end, or are interrupted, within that period), then the
        devstack, then the provider's connections, then export the devstack's last spans
        (at most ``TRACING_FLUSH_S``, and never past the period).

        A call while a stop runs waits for it, and hurries it when its ``grace`` ends
        earlier (a second Ctrl-C; decision 0185)."""
        grace = self.settings.server.grace_s if grace is None else max(0.0, grace)
        if self._stopped is not None:
            if not self._stopped.done() and time.monotonic() + grace < self._deadline:
                self._deadline = time.monotonic() + grace
                await self.planner.stop(grace)
                if self._flushing and self.tracing is not None:
                    await self.tracing.shutdown(self._remaining())
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        self._deadline = time.monotonic() + grace
        try:
            await self._stop(grace)
        finally:
            self._stopped.set_result(None)

    def _remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic() - EXIT_RESERVE_S)

    async def _stop(self, grace: float) -> None:
        try:
            await self.planner.stop(grace)
        finally:
            try:
                # The planner's calls are over; others get what is left, up to 1 s.
                await self.stack.stop(min(STACK_GRACE_S, self._remaining()))
            finally:
                aclose = getattr(self.provider, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.tracing is not None:
                    self._flushing = True
                    await self.tracing.shutdown(min(TRACING_FLUSH_S, self._remaining()))


#: Seconds given to exporting the devstack's spans still queued at exit (less when the
#: grace period has less left).
TRACING_FLUSH_S = 2.0
#: Seconds the devstack's own calls get to finish once the planner stopped.
STACK_GRACE_S = 1.0


async def start_dev(
    options: DevOptions,
    environ: Mapping[str, str] | None = None,
    *,
    settings: Settings | None = None,
) -> DevApp:
    """Start the devstack and the planner; returns once both serve. ``settings``: those
    ``dev_settings(options, environ)`` returned, when the caller loaded them already.

    Raises ``ConfigError`` (a setting, an ``OTEL_*`` variable), ``DevError`` (the model
    provider, an address in use, an input file that cannot be imported), ``StartupError``
    (the planner). The process's ``OTEL_*`` variables trace both, each under its own
    service name (decision 0190).
    """
    started = time.perf_counter()
    settings = settings or dev_settings(options, environ)
    tracing = planner_tracing(settings)
    try:
        stack_tracing = tracing_from_environment("ballet-devstack")
    except TracingConfigError as error:  # pragma: no cover - planner_tracing said it first
        raise DevError(str(error)) from error
    try:
        return await _start_dev(options, environ, settings, (tracing, stack_tracing), started)
    except BaseException:
        for each in (tracing, stack_tracing):
            if each is not None:
                await each.shutdown(0.5)
        raise


async def _start_dev(
    options: DevOptions,
    environ: Mapping[str, str] | None,
    settings: Settings,
    tracings: tuple[Tracing | None, Tracing | None],
    started: float,
) -> DevApp:
    tracing, stack_tracing = tracings
    try:
        provider, description = make_provider(options.provider, options.scenario, environ)
    except ProviderSetupError as error:
        raise DevError(str(error)) from error
    gateway: list[GatewayServicer] = []

    try:
        # The folder first: a dev secret that cannot be read there is not the problem.
        datadir.prepare(settings.data_dir, "give --data-dir a writable folder")
    except datadir.DataDirError as error:
        raise DevError(str(error)) from None
    # The gateway serves only the planner's credential, as the backends check theirs.
    try:
        trust = Trust.dev(dev_secret(settings.data_dir))
    except DevSecretError as error:
        raise DevError(str(error)) from None
    except OSError as error:
        reason = (error.strerror or str(error)).lower()
        raise DevError(
            f"data directory {settings.data_dir}: cannot read the dev secret ({reason}); "
            "give --data-dir a writable folder"
        ) from None

    def add_gateway(server: grpc.aio.Server) -> None:
        gateway.append(add_gateway_service(server, provider, trust=trust))

    try:
        stack = await DevStack.start(
            DevStackConfig(
                data_dir=settings.data_dir,
                database_url=options.database_url,
                address=options.devstack_address,
                tracker_file=options.tracker_file,
                project_id=options.project_id,
                knowledge_dir=options.knowledge_dir,
                skills_dir=options.skills_dir,
                extra_services=add_gateway,
                interceptors=(stack_tracing.server_interceptor(),) if stack_tracing else (),
            )
        )
    except DatabaseUnreachable as error:
        raise DevError(f"devstack: {error}") from None
    except OSError as error:
        raise DevError(f"devstack: {error}; choose another with --devstack-address") from None
    except ImportFileError as error:
        raise DevError(str(error)) from error
    except ValueError as error:
        raise DevError(f"devstack: {error}") from error
    try:
        settings = _pointed_at(settings, stack.address)
        if not settings.database.is_sqlite:
            # `serve` never migrates PostgreSQL (a job does, so replicas never race); dev is
            # one developer's single process, so it brings its own schema up to date
            # (docs/decisions/0050-dev-command.md).
            await migrate_database(settings.database.url)
        planner = await start_planner(settings, tracing=tracing)
    except BaseException:
        await stack.stop()
        raise
    return DevApp(
        options=options,
        settings=settings,
        stack=stack,
        gateway=gateway[0],
        planner=planner,
        provider=provider,
        provider_description=description,
        ready_s=time.perf_counter() - started,
        tracing=stack_tracing,
    )


def _pointed_at(settings: Settings, address: str) -> Settings:
    """``settings`` with every dependency channel at the devstack's ``address``: plaintext
    on loopback (the devstack has no TLS), message sizes as configured."""
    deps = settings.dependencies

    def devstack(channel: ChannelSettings) -> ChannelSettings:
        return ChannelSettings(address=address, max_message_bytes=channel.max_message_bytes)

    pointed = dataclasses.replace(
        deps,
        tracker=devstack(deps.tracker),
        skills=devstack(deps.skills),
        knowledge=devstack(deps.knowledge),
        gateway=devstack(deps.gateway),
    )
    return dataclasses.replace(settings, dependencies=pointed)


def banner(app: DevApp) -> str:
    """What ``dev`` prints once ready: addresses, data, and ready-to-paste commands."""
    options, settings, stack = app.options, app.settings, app.stack
    project = options.project
    data_dir = settings.data_dir
    database = "SQLite: planner.db, devstack.db" if settings.database.is_sqlite else "PostgreSQL"
    metrics = (
        f"; metrics http://{app.planner.metrics_address}/metrics"
        if app.planner.metrics_address
        else ""
    )
    report = stack.report
    if report.beads is not None:
        loaded = f"{report.beads.items} items imported from {options.tracker_file}"
    else:
        loaded = "the built-in demo project"
    if report.adrs is not None:
        loaded += f"; {report.adrs.created + report.adrs.updated + report.adrs.unchanged} ADRs"
    if report.skills is not None:
        loaded += f"; {len(report.skills.versions)} skills"
    # Absolute, so the lines work pasted into a terminal in any folder.
    shown_dir = data_dir.absolute()
    quoted_dir = shlex.quote(str(shown_dir))
    chat = ["ballet-planner", "chat", "--project", project, "--user", "alice"]
    chat += ["--data-dir", str(shown_dir)]
    if app.planner.address != PLANNER_ADDRESS:
        chat += ["--address", app.planner.address]
    token = f"$(ballet-planner token --user alice --data-dir {quoted_dir})"
    body = json.dumps({"project_id": project})
    lines = [
        f"ballet-planner dev: ready in {app.ready_s:.1f} s",
        f"  planner    {app.planner.address}  (ballet.planner.v1.PlannerService{metrics})",
        f"  devstack   {stack.address}  (tracker, skills, knowledge, LLM gateway)",
        f"  model      {app.provider_description}",
        f"  project    {project} of organization acme: {loaded}",
        *(
            f"  {'users' if index == 0 else '':<10} {line}"
            for index, line in enumerate(describe_users({"globex": GLOBEX_PROJECT_ID}))
        ),
        f"  data       {shown_dir} ({database})",
        "",
        "Chat in the terminal:",
        f"  {shlex.join(chat)}",
        "A token for other clients:",
        f"  ballet-planner token --user alice --data-dir {quoted_dir}",
        f"buf curl (server reflection on both addresses; get buf with `{BUF_INSTALL}` in the "
        f"checkout, then run {BUF_PROGRAM}, or use grpcurl the same way):",
        f'  buf curl --protocol grpc --http2-prior-knowledge -H "authorization: Bearer {token}"'
        f" -d '{body}' http://{app.planner.address}/ballet.planner.v1.PlannerService/ListSessions",
        f"  buf curl --protocol grpc --http2-prior-knowledge --list-services http://{stack.address}",
        "Stop with Ctrl-C.",
    ]
    return "\n".join(lines)


def ready_values(app: DevApp) -> dict[str, str]:
    """What ``--ready-file`` holds: the bound ``address``, ``metrics_address`` (empty:
    off) and ``devstack_address``, the absolute ``data_dir`` and the ``project``."""
    return {
        "address": app.planner.address,
        "metrics_address": app.planner.metrics_address,
        "devstack_address": app.stack.address,
        "data_dir": str(app.settings.data_dir.absolute()),
        "project": app.options.project,
    }


def stopping_message(planner: PlannerApp) -> str:
    """What a graceful stop waits for, and how to skip it (decision 0185;
    ``ballet_common.signals.stopping_message``)."""
    grace, running = planner.settings.server.grace_s, planner.running_turns
    return stopping_text(
        grace, running, planner.turns_end_within_s, "press Ctrl-C again to stop at once"
    )


async def run_dev(options: DevOptions, settings: Settings | None = None) -> int:
    """Start, print the banner, serve until SIGINT or SIGTERM, then stop cleanly within
    the planner's ``server.grace_s``, saying what the stop waits for; a second signal
    during the stop skips to its end (decision 0185). Returns the exit code: 0, or
    ``128 + signum`` when a second signal hurried the stop."""
    app = await start_dev(options, settings=settings)
    # A data directory created by this start is held from now on.
    if isinstance(hold_data_dir(app.planner.settings.data_dir), str):
        log.warning("dev: another dev holds the data directory too")

    def stopping(signum: int) -> None:
        print(f"ballet-planner dev: {stopping_message(app.planner)}", flush=True)

    def hurrying(signum: int) -> None:
        running = app.planner.running_turns
        turns = f"interrupting {running} running turn{'s' if running != 1 else ''}"
        print(f"ballet-planner dev: stopping at once: {turns}", flush=True)

    with StopSignals("ballet-planner dev") as signals:
        try:
            print(banner(app), flush=True)
            if options.ready_file is not None:
                write_ready_file(options.ready_file, ready_values(app))
            code = await stop_when_signalled(signals, app.stop, on_stop=stopping, on_hurry=hurrying)
        finally:
            remove_ready_file(options.ready_file)
            await app.stop(0 if signals.hurried.is_set() else None)
    left = app.planner.turns_left_running
    if left is None:
        print(
            "ballet-planner dev: the database did not say whether turns were left running; "
            "any are closed INTERRUPTED by the sweeper once their lease lapses",
            flush=True,
        )
    elif left:
        print(
            f"ballet-planner dev: {left} turn{'s' if left != 1 else ''} left running for the "
            "sweeper (closed INTERRUPTED once their lease lapses)",
            flush=True,
        )
    print("ballet-planner dev: stopped", flush=True)
    return code


def hold_data_dir(data_dir: Path) -> IO[str] | str | None:
    """Lock ``data_dir`` for this ``dev`` for the life of the process (decision 0274;
    ``ballet_common.datadir.hold``)."""
    return datadir.hold(data_dir, "dev")
