"""The composition root: settings in, a running planner out (docs/contributing.md).

``start_planner(settings)`` is ``build_planner`` (a plain function: everything wired and
the address bound, nothing started) and then ``PlannerApp.start()``, whose undoing is
``PlannerApp.stop()`` beside it (decision 0333); ``service.server.serving.serve`` does
that, then waits for SIGTERM or SIGINT and shuts down gracefully. Nothing else in
the service builds engines, channels or servers, and nothing does I/O at import time.

Start-up order: tracing, when the ``OTEL_*`` variables ask for it (``planner_tracing``;
decision 0190); metrics; token verification (dev mode: the HS256 secret of the data
dir, a WARNING, ``ballet_planner_dev_mode`` = 1); the service credentials (one per
dependency audience) and the page-token keys; the database (SQLite: migrate here,
with a WARNING, since SQLite means a single process; PostgreSQL: never migrate, and
refuse to start while the schema is behind); the store; outbound channels and backend
clients; the session rules; the turn side (``service.server.wiring.build_turns``); the gRPC
server with PlannerService, health and reflection; the health monitor; the metrics
endpoint; the retention job, when ``[retention]`` asks for it (``service.server.retention``).

Shutdown (docs/spec/operations.md; decision 0181): health NOT_SERVING first, then the server stops
accepting calls; running turns end within the grace period (or are stopped and closed
``INTERRUPTED`` by the turn machinery), then every Chat stream ends
``UNAVAILABLE``/``SHUTTING_DOWN``; then the metrics endpoint, channels and the database
close, and the spans still queued are exported (at most 2 s; decision 0190). The whole
takes at most the grace period. A second signal during it skips to its end: turns are
interrupted at once and the process exits 128 + the signal's number (decision 0185).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from ballet.planner.v1 import planner_service_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ballet_common import datadir, ports
from ballet_common.databases import unreachable
from ballet_common.files import DatabaseFileError, private_directory
from ballet_common.grpc.channels import ChannelTls, make_channel
from ballet_common.tokens import DevSecretError
from ballet_common.tracing import Tracing, TracingConfigError, tracing_from_environment
from service.adapters.backends import GrpcToolBackends
from service.adapters.clock import SystemClock
from service.adapters.store import migrate, schema_status
from service.adapters.store.database import Database, open_database
from service.adapters.store.engine import prepare_sqlite_file
from service.adapters.tracing import OtelTracer
from service.config import (
    SHUTDOWN_OVERHEAD_S,
    ChannelSettings,
    ConfigError,
    Settings,
    channels,
    check_context_budget,
    split_address,
)
from service.core.errors import StoreUnavailable
from service.core.pages import PageTokens
from service.core.ports import (
    Clock,
    SessionStore,
    ToolBackends,
)
from service.core.retention import RetentionJob
from service.core.sessions import ProjectAccess, SessionLimits, SessionRules
from service.core.tools import declarations
from service.core.tracing import NULL_TRACER
from service.core.turn.prompt import shared_prefix
from service.server.identity import page_token_keys, service_credentials, token_verifier
from service.server.logs import quiet_clients_gone
from service.server.metrics import Metrics, MetricsInterceptor, MetricsServer, start_metrics_server
from service.server.retention import retention_job
from service.server.wiring import (
    PlannerTurns,
    Wiring,
    build_turns,
    project_directory,
    socket_bounds,
)
from service.transport import convert
from service.transport.auth import Authenticator
from service.transport.decoding import add_planner_service
from service.transport.servicer import PlannerServicer
from service.version import version

log = logging.getLogger(__name__)

#: The service name health checking reports besides the overall ``""``.
SERVICE_NAME = planner_service_pb2.DESCRIPTOR.services_by_name["PlannerService"].full_name
#: A health service name that stays SERVING while the process serves, whatever the
#: database does: the target of liveness probes that can only ask for SERVING, such as
#: Kubernetes' native gRPC probe (docs/decisions/0163-deployment.md).
LIVENESS_SERVICE = "liveness"
#: A database ping slower than this counts as a failure (seconds).
PING_TIMEOUT_S = 5.0
#: While the database is unreachable it is pinged this often (seconds, at most the
#: health interval), so a replica is SERVING within this of the database's return: the
#: ping opens a connection of its own, it does not wait for a pool's backoff (decision
#: 0312).
RECOVERY_PING_S = 0.2
#: Shutdown: the end of the grace period kept for closing channels and pools, and before
#: it the time the streams get to deliver their end (``config.SHUTDOWN_OVERHEAD_S``).
CLOSE_RESERVE_S = 0.5
STREAMS_END_S = 0.5
#: The end of the grace period no export of spans may use: the process's exit after the
#: stop (the interpreter's teardown of gRPC and the rest) takes about 0.3-0.5 s, and in
#: ``dev`` the devstack stops after the planner (decision 0190).
EXIT_RESERVE_S = 1.0
#: At most this long to ask the store, once the turns stopped, whether any was left.
CHECK_LEFT_S = 1.0


class StartupError(RuntimeError):
    """The planner cannot start; the message says why and what to do. ``setting``: the
    setting to change (e.g. ``server.address``), when one is at fault, so that a command
    can name its own flag for it."""

    def __init__(self, message: str, *, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


# --------------------------------------------------------------------------- the app


@dataclass(frozen=True)
class PlannerParts:
    """A planner built and bound but not started (``build_planner``): what ``PlannerApp``
    starts and stops. ``address`` is ``host:port`` as bound."""

    settings: Settings
    address: str
    server: Any
    health: HealthServicer
    metrics: Metrics
    database: Database
    channels: Sequence[Any]
    turns: PlannerTurns
    tracing: Tracing | None = None
    retention: RetentionJob | None = None


class PlannerApp:
    """A planner: ``start()`` serves, ``stop()`` shuts down, in the reverse order.
    ``address`` and ``metrics_address`` are ``host:port`` as bound (``metrics_address``
    is empty when metrics are off, or before ``start``)."""

    def __init__(self, parts: PlannerParts) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.address = parts.address
        self.metrics_address = ""
        self.metrics = parts.metrics
        self.health = parts.health
        self.database = parts.database
        self.store: SessionStore = parts.database.sessions
        #: After ``stop``: turns of this replica still running in the store (left for the
        #: sweeper); None when the store could not tell, or a ``stop(0)`` did not ask.
        self.turns_left_running: int | None = 0
        self._metrics_server: MetricsServer | None = None
        self._stopping = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._deadline: float | None = None
        self._flushing = False

    @property
    def running_turns(self) -> int:
        """Turns running in this process now."""
        return self.parts.turns.turns.running

    @property
    def turns_end_within_s(self) -> float:
        """Seconds from the start of a graceful stop that running turns get to end on
        their own before they are stopped ``INTERRUPTED`` (``grace_s - cancel_grace - 2``;
        decision 0181)."""
        settings = self.settings
        grace, cancel_grace = settings.server.grace_s, settings.planner.cancel_grace
        return max(0.0, grace - cancel_grace - SHUTDOWN_OVERHEAD_S)

    async def start(self) -> None:
        """Serve, in this order: the turns (start-up recovery, leases, the sweeper), the
        gRPC server, health SERVING (and liveness), the database monitor, the metrics
        endpoint, the retention job; ``stop`` undoes them in the reverse order. A failure
        stops what started (``stop(0)``) and raises: ``StartupError`` when the metrics
        address cannot be bound."""
        parts, settings = self.parts, self.settings
        try:
            await parts.turns.start()
            await parts.server.start()
            await self._set_health(True)
            await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            self.metrics.database_up.set(1)
            self._monitor = asyncio.get_running_loop().create_task(
                self._watch_database(settings.server.health_check_interval_s),
                name="health-monitor",
            )
            if settings.server.metrics_address:
                self._metrics_server = _serve_metrics(self.metrics, settings)
                self.metrics_address = self._metrics_server.address
            if parts.retention is not None:
                parts.retention.start()
        except BaseException:
            await self.stop(0)
            raise

    async def stop(self, grace: float | None = None) -> None:
        """Shut down within ``grace`` seconds (default ``server.grace_s``): health
        NOT_SERVING first, then stop the server and the turns, then close everything.

        Idempotent. A call while a stop runs waits for it, and hurries it when its
        ``grace`` ends earlier than the stop in progress would: the stop skips ahead to
        that end (turns stopped and closed ``INTERRUPTED`` at once, calls cancelled,
        the rest closed in what is left; decision 0185). ``turns_left_running`` says
        afterwards whether any turn of this process was left for the sweeper."""
        grace = self.settings.server.grace_s if grace is None else max(0.0, grace)
        if self._stopped is not None:
            hurried = self._deadline is not None and time.monotonic() + grace < self._deadline
            if hurried and not self._stopped.done():
                await self._hurry(grace)
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        self._deadline = time.monotonic() + grace
        try:
            await self._shutdown()
        finally:
            self._stopped.set_result(None)

    def _remaining(self) -> float:
        assert self._deadline is not None
        return max(0.0, self._deadline - time.monotonic())

    async def _shutdown(self) -> None:
        parts = self.parts
        grace = self._remaining()
        await self.health.enter_graceful_shutdown()
        self.metrics.ready.set(0)
        log.info("shutting down: health NOT_SERVING")
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.wait({self._monitor})
        if parts.retention is not None:  # its batch in progress ends, then the pass
            await parts.retention.stop()
        # The server stops accepting calls now and cancels those still running at the
        # end of the budget; the turns, and then the streams, end before that; the rest
        # of the grace period closes channels and pools (decision 0181).
        reserve = min(CLOSE_RESERVE_S, grace / 4)
        budget = max(0.0, self._remaining() - reserve)
        server_stopped = asyncio.ensure_future(parts.server.stop(budget))
        await parts.turns.stop(max(0.0, budget - min(STREAMS_END_S, budget / 4)))
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        await server_stopped
        await self._check_turns_left()
        for channel in parts.channels:
            await channel.close()
        await self.database.close(self._remaining())
        if parts.tracing is not None:
            # Exiting within the grace period comes first: what the collector has not
            # taken by then is dropped (decision 0190).
            self._flushing = True
            await parts.tracing.shutdown(self._remaining() - EXIT_RESERVE_S)
        log.info("stopped")

    async def _hurry(self, grace: float) -> None:
        """Move the end of the stop in progress to ``grace`` seconds from now: the
        server cancels its calls and the turns' stop skips ahead (``PlannerTurns.hurry``)."""
        self._deadline = time.monotonic() + grace
        log.warning("shutting down at once: running turns are interrupted now")
        reserve = min(CLOSE_RESERVE_S, grace / 4)
        budget = max(0.0, grace - reserve)
        server_stopped = asyncio.ensure_future(self.parts.server.stop(budget))
        await self.parts.turns.hurry(max(0.0, budget - min(STREAMS_END_S, budget / 4)))
        await server_stopped
        tracing = self.parts.tracing
        if self._flushing and tracing is not None:
            await tracing.shutdown(self._remaining() - EXIT_RESERVE_S)

    async def _check_turns_left(self) -> None:
        # The turns' stop closes every turn it ran unless the store failed it; what is
        # left is the sweeper's, and whoever stopped the process is told (decision 0185).
        # A stop with no time left (stop(0)) does not ask.
        budget = min(CHECK_LEFT_S, self._remaining() - CLOSE_RESERVE_S / 2)
        if budget <= 0:
            self.turns_left_running = None
            return
        try:
            left = await asyncio.wait_for(
                self.store.running_turns(owner=self.settings.server.replica_id), budget
            )
        except (StoreUnavailable, TimeoutError):
            self.turns_left_running = None
            log.warning("shutting down: the database did not say whether turns are left running")
            return
        self.turns_left_running = len(left)
        if left:
            log.warning("shutting down: %d turn(s) left running for the sweeper", len(left))

    async def wait_for_termination(self) -> None:
        """Wait until the gRPC server has stopped."""
        await self.parts.server.wait_for_termination()

    async def _watch_database(self, interval_s: float) -> None:
        serving = True
        # A replica whose database has not answered for a lease's length holds no valid
        # lease any more (each was renewed at most then): its streams go (decision 0314).
        let_go_after_s = self.settings.planner.lease_s
        last_answer = time.monotonic()
        let_go = False
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self.store.ping(), PING_TIMEOUT_S)
                healthy = True
                last_answer = time.monotonic()
                let_go = False
            except (StoreUnavailable, TimeoutError):
                healthy = False
            except Exception:
                log.exception("database ping failed unexpectedly")
                healthy = False
            if healthy != serving:
                serving = healthy
                await self._set_health(serving)
                if serving:
                    log.warning("database reachable again: health SERVING")
                else:
                    log.warning("database unreachable: health NOT_SERVING")
            self.metrics.database_up.set(1 if healthy else 0)
            if not healthy and not let_go and time.monotonic() - last_answer >= let_go_after_s:
                let_go = True
                self._let_clients_go(time.monotonic() - last_answer)
            wait_s = interval_s if serving else min(interval_s, RECOVERY_PING_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), wait_s)

    def _let_clients_go(self, silent_s: float) -> None:
        ended = self.parts.turns.hub.let_go(
            "this replica cannot reach its database; reopen the stream on another replica "
            "with after_sequence"
        )
        log.warning(
            "database silent for %.1f s: this replica's leases have expired; %d Chat "
            "stream(s) ended UNAVAILABLE/REPLICA_UNAVAILABLE",
            silent_s,
            ended,
        )

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)
        self.metrics.ready.set(1 if serving else 0)


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """The grpc.aio server options: receive limit, keepalive, client pings, HTTP/2
    streams per connection (docs/spec/operations.md; decision 0210).

    The server pings every ``server.keepalive_time_s`` and closes a connection whose
    ping is not answered within ``server.keepalive_timeout_s``: with this grpcio the
    wait is ``grpc.http2.ping_timeout_ms`` (``grpc.keepalive_timeout_ms`` alone leaves
    it at 60 s), so both are set. Client pings are accepted every
    ``server.min_ping_interval_s`` (``grpc.http2.min_ping_interval_without_data_ms``)
    with or without calls; ``server.max_ping_strikes``
    early ones in a row end the connection with GOAWAY ENHANCE_YOUR_CALM. No
    ``max_connection_idle``: a Chat stream may stay idle for hours."""
    server = settings.server
    keepalive_timeout_ms = int(server.keepalive_timeout_s * 1000)
    min_ping_interval_ms = int(server.min_ping_interval_s * 1000)
    return [
        ("grpc.max_receive_message_length", server.max_receive_message_bytes),
        ("grpc.keepalive_time_ms", int(server.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms),
        # The shortest interval between client pings the server accepts (C-core's
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is spelled this way;
        # "grpc.http2.min_recv_ping_interval_without_data_ms" is no option at all).
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.max_ping_strikes", server.max_ping_strikes),
        ("grpc.max_concurrent_streams", server.max_concurrent_streams),
        # gRPC sets SO_REUSEPORT by default: a second process would bind the same port
        # silently and take part of the traffic. A port in use must be an error.
        ("grpc.so_reuseport", 0),
    ]


def _channel_tls(channel: ChannelSettings) -> ChannelTls | None:
    if not channel.uses_tls:
        return None
    return ChannelTls(
        ca_file=channel.tls_ca,
        cert_file=channel.tls_cert,
        key_file=channel.tls_key,
        server_name=channel.tls_server_name or None,
    )


def _make_channels(settings: Settings, tracing: Tracing | None) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for name, channel in channels(settings.dependencies):
        try:
            made[name] = make_channel(
                channel.address,
                tls=_channel_tls(channel),
                insecure=channel.insecure,
                max_receive_bytes=channel.max_message_bytes,
                interceptors=tracing.client_interceptors(channel.address) if tracing else (),
            )
        except ValueError as error:
            raise ConfigError(f"dependencies.{name}.address: {error}") from error
        except OSError as error:
            raise ConfigError(f"dependencies.{name}.tls_*: cannot read: {error}") from error
    return made


def _server_credentials(settings: Settings) -> Any | None:
    server = settings.server
    if server.tls_cert is None or server.tls_key is None:
        return None
    try:
        pair = (server.tls_key.read_bytes(), server.tls_cert.read_bytes())
        ca = server.tls_ca.read_bytes() if server.tls_ca is not None else None
    except OSError as error:
        raise ConfigError(f"server.tls_cert: cannot read: {error}") from error
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=server.tls_require_client_cert
    )


def planner_tracing(settings: Settings) -> Tracing | None:
    """Tracing as the process's ``OTEL_*`` variables ask, or None (off: nothing is
    installed); service ``ballet-planner``, instance ``server.replica_id``
    (``ballet_common.tracing``; decision 0190). Raises ``ConfigError`` naming the
    variable that cannot be used."""
    try:
        return tracing_from_environment(
            "ballet-planner",
            service_version=version(),
            instance_id=settings.server.replica_id,
        )
    except TracingConfigError as error:
        raise ConfigError(str(error)) from error


async def _open_database(settings: Settings, tracing: Tracing | None) -> Database:
    url = settings.database.url
    try:
        if settings.database.is_sqlite:
            # Transcripts: 0600 in a 0700 directory whatever the umask.
            private_directory(settings.data_dir)
            try:
                prepare_sqlite_file(url)
            except DatabaseFileError as error:
                raise StartupError(str(error)) from None
            await migrate(url)
            log.warning(
                "SQLite database: single process only; its schema was migrated at start "
                "(use PostgreSQL and `ballet-planner migrate` in production)"
            )
        else:
            status = await schema_status(url)
            if status.behind:
                raise StartupError(f"{status}: run `ballet-planner migrate` first")
        database = settings.database
        return await open_database(
            url,
            replica_id=settings.server.replica_id,
            pool_size=database.pool_size,
            max_overflow=database.max_overflow,
            hot_pool_size=database.hot_pool_size,
            pool_timeout_s=database.pool_timeout_s,
            connect_timeout_s=database.connect_timeout_s,
            pool_pre_ping=database.pool_pre_ping,
            abandoned_read_grace_s=database.abandoned_read_grace_s,
            unit_timeout_s=database.unit_timeout_s,
            bounds=socket_bounds(database),
            context_cache_bytes=database.context_cache_bytes,
            tracer=OtelTracer(tracing.tracer) if tracing else NULL_TRACER,
        )
    except StoreUnavailable as error:
        raise StartupError(
            f"{unreachable(url, error)}; is the database running there, and is "
            "database.url (BALLET_PLANNER__DATABASE__URL) right?",
            setting="database.url",
        ) from None


async def migrate_database(url: str) -> None:
    """Upgrade the schema of the database at ``url`` (a SQLAlchemy URL) to this release,
    as ``ballet-planner migrate`` does; the public way for other tools (the devstack's
    ``dev``) to do it. Raises ``StartupError`` when the database is unreachable."""
    try:
        await migrate(url)
    except StoreUnavailable as error:
        raise StartupError(f"{unreachable(url, error)}; is the database running there?") from None


def _bind(server: Any, address: str, credentials: Any | None) -> int:
    if ports.in_use(address):
        raise StartupError(
            f"server.address {address} is in use (another planner, or dev?): stop it, or "
            "choose a free address (server.address, BALLET_PLANNER__SERVER__ADDRESS)",
            setting="server.address",
        )
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as error:
        raise StartupError(
            f"server.address: cannot bind {address}: {error}", setting="server.address"
        ) from error
    if not port:
        raise StartupError(f"server.address: cannot bind {address}", setting="server.address")
    return int(port)


async def start_planner(
    settings: Settings,
    *,
    backends: ToolBackends | None = None,
    clock: Clock | None = None,
    turn_machinery: Callable[[Wiring], PlannerTurns] = build_turns,
    tracing: Tracing | None = None,
) -> PlannerApp:
    """Build and start a planner from ``settings``; returns once it serves.

    ``backends`` replaces the gRPC backend clients and ``turn_machinery`` builds the turn
    side from the wiring (tests put doubles in either). ``tracing`` (``planner_tracing``;
    None: off) traces the RPCs, turns and units of work; the planner owns it from here and
    shuts it down when it stops. Binds ``server.address`` (port 0: a free port, see
    ``PlannerApp.address``). Raises ``ConfigError`` (a setting that cannot be used, e.g.
    an unreadable certificate) and ``StartupError`` (database unreachable or behind,
    address in use).
    """
    try:
        app = await build_planner(
            settings,
            backends=backends,
            clock=clock,
            turn_machinery=turn_machinery,
            tracing=tracing,
        )
        await app.start()
        return app
    except BaseException:
        if tracing is not None:
            await tracing.shutdown(CLOSE_RESERVE_S)
        raise


async def build_planner(
    settings: Settings,
    *,
    backends: ToolBackends | None = None,
    clock: Clock | None = None,
    turn_machinery: Callable[[Wiring], PlannerTurns] = build_turns,
    tracing: Tracing | None = None,
) -> PlannerApp:
    """Build a planner from ``settings`` and bind its address, without starting
    anything (``start_planner``'s arguments and errors); the database is open, so
    ``start()`` and then ``stop()`` the app it returns. Raises ``ConfigError`` and
    ``StartupError``, having closed what it opened."""
    # A client that gave up is not an error of the planner (decision 0313).
    quiet_clients_gone()
    # The context budget with the fixed prompt as rendered (decision 0293).
    check_context_budget(settings.planner, shared_prefix(declarations()).tokens)
    if settings.dev_mode or settings.database.is_sqlite:
        try:
            datadir.prepare(settings.data_dir)
        except datadir.DataDirError as error:
            raise StartupError(str(error)) from None
    metrics = Metrics()
    try:
        verifier = token_verifier(settings)
        credentials = service_credentials(settings)
        page_tokens = PageTokens(page_token_keys(settings))
    except DevSecretError as error:
        raise StartupError(str(error)) from None
    except OSError as error:
        # The dev secret or the page-token key of the data directory cannot be used: one
        # line saying so (production reads its key files at first use instead).
        problem = datadir.unusable(settings.data_dir, error, "use the dev secret")
        raise StartupError(str(problem)) from error
    if verifier.dev_mode:
        log.warning(
            "dev mode: no auth.jwks_path, bearer tokens are checked with the HS256 dev "
            "secret of the data directory; serving on loopback only"
        )
    metrics.dev_mode.set(1 if verifier.dev_mode else 0)
    clock = clock or SystemClock()
    database = await _open_database(settings, tracing)
    pools, hot = settings.database, database.pool is not None
    limit = pools.pool_size + pools.max_overflow + (pools.hot_pool_size if hot else 0)
    metrics.watch_database(database.checked_out, limit, database.units_of_work.on_failure)
    if database.sessions.signals is not None:
        database.sessions.signals.watch(metrics.count_signal)
    opened: list[Any] = []
    try:
        store = database.sessions
        outbound = _make_channels(settings, tracing)
        opened.extend(outbound.values())
        if backends is None:
            backends = GrpcToolBackends(
                tracker=outbound["tracker"],
                skills=outbound["skills"],
                knowledge=outbound["knowledge"],
                tracker_credential=credentials["tracker"].token,
                skills_credential=credentials["skills"].token,
                knowledge_credential=credentials["knowledge"].token,
            )
        authenticator = Authenticator(verifier)
        projects = project_directory(settings, backends, clock)
        rules = SessionRules(
            store,
            ProjectAccess(projects),
            clock,
            SessionLimits(
                page_max_bytes=settings.limits.page_max_bytes,
                client_message_max_bytes=settings.limits.client_message_max_bytes,
            ),
            page_tokens=page_tokens,
            message_size=convert.encoded_message_bytes,
        )
        turns = turn_machinery(
            Wiring(
                settings=settings,
                store=store,
                backends=backends,
                gateway_channel=outbound["gateway"],
                service_credentials=credentials,
                authenticator=authenticator,
                rules=rules,
                clock=clock,
                metrics=metrics,
                streams=database.streams,
                tracer=OtelTracer(tracing.tracer) if tracing else NULL_TRACER,
                projects=projects,
            )
        )

        # Tracing first: the metrics, and everything the handler does, run in its span.
        interceptors: list[Any] = [tracing.server_interceptor()] if tracing else []
        interceptors.append(MetricsInterceptor(metrics))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=server_options(settings),
            maximum_concurrent_rpcs=settings.server.maximum_concurrent_rpcs,
        )
        metrics.grpc_max_concurrent_rpcs.set(settings.server.maximum_concurrent_rpcs)
        # Undecodable requests: INVALID_ARGUMENT, not UNKNOWN (service.transport.decoding).
        add_planner_service(PlannerServicer(rules, authenticator, turns.chat), server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_name, reflection.SERVICE_NAME), server
        )
        host, _ = split_address(settings.server.address, "server.address")
        port = _bind(server, settings.server.address, _server_credentials(settings))
    except BaseException:
        for channel in opened:
            await channel.close()
        await database.close()
        raise
    shown_host = f"[{host}]" if ":" in host else host
    return PlannerApp(
        PlannerParts(
            settings=settings,
            address=f"{shown_host}:{port}",
            server=server,
            health=health,
            metrics=metrics,
            database=database,
            channels=list(outbound.values()),
            turns=turns,
            tracing=tracing,
            retention=retention_job(settings, database, turns, clock, metrics),
        )
    )


def _serve_metrics(metrics: Metrics, settings: Settings) -> MetricsServer:
    """The ``/metrics`` endpoint on ``server.metrics_address``; ``StartupError`` when the
    address cannot be bound."""
    address = settings.server.metrics_address
    try:
        return start_metrics_server(metrics, address)
    except OSError as error:
        # A port in use wants another port; a host that does not resolve, or is not
        # this machine's, wants another host.
        what = (
            "choose a free address"
            if error.errno == errno.EADDRINUSE
            else "give an address of this machine, e.g. 127.0.0.1:9464, or empty to turn "
            "the endpoint off"
        )
        raise StartupError(
            f"server.metrics_address: cannot bind {address} "
            f"({(error.strerror or str(error)).lower()}): {what} "
            "(server.metrics_address, BALLET_PLANNER__SERVER__METRICS_ADDRESS)",
            setting="server.metrics_address",
        ) from error
