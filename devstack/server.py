"""``DevStack``: the tracker, skills and knowledge backends on one grpc.aio server.

The composition root of the dependencies for development, tests and benchmarks (README.md).
``DevStack.start`` creates the schema, seeds the organizations and users, loads the demo project or
imports a beads export, imports knowledge and skills, then serves the three backends with gRPC
health and server reflection on one address. The LLM gateway (``devstack.gateway``) joins the same
server through
``DevStackConfig.extra_services``.

Tests read ``calls`` (every RPC's human, actor and outcome) and ``writes`` (real writes
per request id), and drive ``faults`` (delays and errors per RPC or service).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
from ballet.knowledge.v1 import knowledge_pb2_grpc
from ballet.skills.v1 import skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ballet_common import devusers, ports
from ballet_common.addresses import is_loopback
from ballet_common.files import check_sqlite_file, create_private_file, private_directory
from ballet_common.tokens import (
    HUMAN_AUDIENCES,
    KNOWLEDGE_AUDIENCE,
    PLANNER_SERVICE_SUBJECT,
    SKILLS_AUDIENCE,
    TRACKER_AUDIENCE,
    Trust,
    dev_secret,
    mint_dev_service_token,
    mint_dev_token,
)
from devstack import knowledge, skills, tracker
from devstack.auth import Authenticator
from devstack.calls import CallLog, CallRecord
from devstack.defaults import DEFAULT_ADDRESS as DEFAULT_ADDRESS
from devstack.demo.project import load_demo, load_globex
from devstack.faults import FaultInjector
from devstack.importers.adr import AdrReport, import_adrs
from devstack.importers.beads import BeadsReport, import_beads
from devstack.importers.skills import SkillsReport, import_skills
from devstack.pages import PageTokens
from devstack.rpc import Backend
from devstack.store import Store, sqlite_url
from devstack.store.access import USERS, seed_identities, set_role
from devstack.store.db import SQLITE_FILE

log = logging.getLogger(__name__)

#: The services this module serves itself (reflection and health list them).
SERVICE_NAMES = (tracker.SERVICE, skills.SERVICE, knowledge.SERVICE)


@dataclass(frozen=True)
class DevStackConfig:
    """How to start a ``DevStack``.

    - ``data_dir``: holds ``devstack.db`` (SQLite) and the ``dev-secret`` (generated on
      first use, shared with the planner's ``dev`` mode), both ``0600`` in a ``0700``
      directory whatever the umask.
    - ``database_url``: a ``postgresql+psycopg://`` URL to use PostgreSQL instead of SQLite.
    - ``address``: ``host:port`` to bind; port 0 picks a free one (see ``DevStack.address``).
    - ``tracker_file``: a beads ``issues.jsonl`` to import as ``project_id``; without it the
      built-in demo project ``demo`` is loaded.
    - ``knowledge_dir``: a folder of ADR markdown files; ``skills_dir``: a folder of
      ``<name>/SKILL.md``. Both optional.
    - ``trust``: the token issuers to trust (``ballet_common.tokens.Trust``: Core's human
      issuer and the service-token issuer, with their keys); None: the dev secret's
      (``Trust.dev``). Every backend checks ``iss``, and the planner's credential must
      come from the service-token issuer for that backend's audience alone.
    - ``allow_non_loopback``: the devstack serves plaintext and, in dev mode, accepts
      tokens signed with a secret on disk, so it binds only loopback addresses unless this
      is set (as docs/spec/authority.md asks of the planner's dev mode).
    - ``token_leeway_s``: clock skew the backends allow on a token's ``exp`` (seconds,
      at most 60 as in docs/spec/authority.md); 0 lets a test see a token refused the moment it
      expires.
    - ``extra_services``: called with the server before it starts, to add services, e.g.
      ``lambda server: add_gateway_service(server, provider)`` for the LLM gateway. The
      services it registers (seen through ``add_generic_rpc_handlers``), plus
      ``extra_service_names``, are listed by reflection and reported SERVING by health;
      its return value is ignored.
    - ``interceptors``: server interceptors of every call, e.g. tracing's
      (``ballet_common.tracing.Tracing.server_interceptor``); none by default.
    - ``max_receive_message_bytes``: the largest request message the server takes; by
      default 32 MiB, what the planner's gateway channel sends by default
      (``dependencies.gateway.max_message_bytes``), since the gateway joins this server.
    """

    data_dir: Path
    database_url: str | None = None
    address: str = DEFAULT_ADDRESS
    tracker_file: Path | None = None
    project_id: str = "demo"
    knowledge_dir: Path | None = None
    skills_dir: Path | None = None
    trust: Trust | None = None
    allow_non_loopback: bool = False
    extra_services: Callable[[grpc.aio.Server], object] | None = None
    extra_service_names: tuple[str, ...] = ()
    token_leeway_s: float = 30.0
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    max_receive_message_bytes: int = 32 * 1024 * 1024


@dataclass(frozen=True)
class StartupReport:
    """What ``start`` loaded, and how long each step took (seconds)."""

    beads: BeadsReport | None = None
    adrs: AdrReport | None = None
    skills: SkillsReport | None = None
    timings: dict[str, float] = field(default_factory=dict)


class DevStack:
    """A running devstack. Create with ``await DevStack.start(config)``; ``await stop()``."""

    def __init__(
        self,
        *,
        config: DevStackConfig,
        store: Store,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        address: str,
        calls: CallLog,
        faults: FaultInjector,
        secret: bytes | None,
        report: StartupReport,
        service_names: tuple[str, ...],
    ) -> None:
        self.config = config
        self.store = store
        self.report = report
        self.service_names = service_names
        self._server = server
        self._health = health_servicer
        self._address = address
        self._calls = calls
        self._faults = faults
        self._secret = secret

    @classmethod
    async def start(cls, config: DevStackConfig) -> DevStack:
        """Create the schema, load the data, and serve on ``config.address``.

        Raises ``ValueError`` for an unsupported database URL, a ``devstack.db`` that is
        not a SQLite database (``DatabaseFileError``) and malformed input files
        (``ImportFileError``), ``OSError`` when the address cannot be bound.
        """
        if not config.allow_non_loopback and not is_loopback(config.address):
            raise ValueError(
                f"{config.address} is not a loopback address; the devstack serves plaintext "
                "(the standalone devstack binds it anyway with --allow-non-loopback: "
                "python -m devstack --allow-non-loopback)"
            )
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[name] = now - clock
            clock = now

        private_directory(config.data_dir)
        secret = dev_secret(config.data_dir) if config.trust is None else None
        data_file = config.data_dir / SQLITE_FILE
        # It holds what humans and the planner wrote: 0600 whatever the umask. One that
        # was there already is checked: a damaged file is one line, not a traceback.
        if config.database_url is None and not create_private_file(data_file):
            check_sqlite_file(data_file)
        store = await Store.open(config.database_url or sqlite_url(config.data_dir))
        try:
            await store.create_schema()
            await store.run_write(seed_identities)
            # Who the chat client may mint tokens for, next to the secret it uses.
            devusers.write(config.data_dir, {user: org for user, (org, _) in USERS.items()})
            await load_globex(store)
            lap("schema")
            beads_report = None
            if config.tracker_file is None:
                await load_demo(store)
                lap("demo")
            else:
                beads_report = await import_beads(
                    store, config.tracker_file, project_id=config.project_id
                )
                lap("tracker")
            adr_report = (
                await import_adrs(store, config.knowledge_dir) if config.knowledge_dir else None
            )
            lap("knowledge")
            skills_report = (
                await import_skills(store, config.skills_dir) if config.skills_dir else None
            )
            lap("skills")
            report = StartupReport(beads_report, adr_report, skills_report, timings)
            return await cls._serve(config, store, secret, report)
        except BaseException:
            await store.close()
            raise

    @classmethod
    async def _serve(
        cls, config: DevStackConfig, store: Store, secret: bytes | None, report: StartupReport
    ) -> DevStack:
        trust = config.trust
        if trust is None:
            assert secret is not None
            trust = Trust.dev(secret)
        # Page tokens are signed with a key derived from the dev secret (or a fixed label
        # in JWKS mode): they only need to be tamper-evident, not secret.
        pages = PageTokens(secret or b"devstack-jwks-mode")
        calls = CallLog()
        faults = FaultInjector()
        # No SO_REUSEPORT (gRPC's default): a second devstack on the same port must fail.
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", config.max_receive_message_bytes),
            ],
            interceptors=config.interceptors or None,
        )

        def backend(service: str, domain: str, audience: str) -> Backend:
            authenticator = Authenticator(trust, audience, leeway_s=config.token_leeway_s)
            return Backend(
                service=service,
                domain=domain,
                authenticator=authenticator,
                calls=calls,
                faults=faults,
            )

        tracker_pb2_grpc.add_TrackerServiceServicer_to_server(
            tracker.TrackerServicer(
                store, backend(tracker.SERVICE, tracker.DOMAIN, TRACKER_AUDIENCE), pages
            ),
            server,
        )
        skills_pb2_grpc.add_SkillsServiceServicer_to_server(
            skills.SkillsServicer(
                store, backend(skills.SERVICE, skills.DOMAIN, SKILLS_AUDIENCE), pages
            ),
            server,
        )
        knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(
            knowledge.KnowledgeServicer(
                store, backend(knowledge.SERVICE, knowledge.DOMAIN, KNOWLEDGE_AUDIENCE), pages
            ),
            server,
        )
        names = [*SERVICE_NAMES]
        if config.extra_services is not None:
            recording = _RecordingServer(server)
            config.extra_services(cast(grpc.aio.Server, recording))
            names.extend(recording.service_names)
        names.extend(config.extra_service_names)
        service_names = tuple(dict.fromkeys(names))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        if ports.in_use(config.address):
            # Said before gRPC tries: its C core would log a line of its own first.
            raise OSError(f"{config.address} is in use (is another devstack or dev running?)")
        try:
            port = server.add_insecure_port(config.address)
        except RuntimeError as error:
            # grpcio reports a port in use as a bare RuntimeError; name the address.
            raise OSError(f"cannot bind {config.address} (is it in use?)") from error
        if port == 0:
            raise OSError(f"cannot bind {config.address}")
        host = config.address.rsplit(":", 1)[0]
        await server.start()
        for name in ("", *service_names):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return cls(
            config=config,
            store=store,
            server=server,
            health_servicer=health_servicer,
            address=f"{host}:{port}",
            calls=calls,
            faults=faults,
            secret=secret,
            report=report,
            service_names=service_names,
        )

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Report NOT_SERVING, stop the server (letting calls finish for ``grace_s``), close
        the database. Safe to call twice."""
        await self._health.enter_graceful_shutdown()
        self._faults.clear()
        await self._server.stop(grace_s)
        await self.store.close()

    @property
    def address(self) -> str:
        """The bound ``host:port`` (the real port when the config asked for port 0)."""
        return self._address

    @property
    def calls(self) -> list[CallRecord]:
        """Every finished backend call so far, oldest first (a copy)."""
        return self._calls.records

    @property
    def call_log(self) -> CallLog:
        """The live call log, to ``wait_for`` a condition or ``clear`` between tests."""
        return self._calls

    def calls_for(self, method: str) -> list[CallRecord]:
        """The finished calls of one RPC name, e.g. ``"ProposeChangeset"``, oldest first."""
        return self._calls.for_method(method)

    @property
    def writes(self) -> Mapping[str, int]:
        """Real writes per ``request_id`` (an idempotent replay adds none)."""
        return self._calls.writes

    @property
    def faults(self) -> FaultInjector:
        """The fault injector: ``faults.set(method="GetItem", delay_s=5)``, ``.clear()``."""
        return self._faults

    @property
    def dev_secret(self) -> bytes:
        """The HS256 dev secret of the data directory; ``RuntimeError`` in JWKS mode."""
        if self._secret is None:
            raise RuntimeError("the devstack verifies tokens with a JWKS file, not a dev secret")
        return self._secret

    def token(
        self,
        user: str,
        *,
        organization_id: str | None = None,
        audiences: Iterable[str] = HUMAN_AUDIENCES,
        ttl_s: float = 3600.0,
    ) -> str:
        """A dev token for ``user`` (``alice``, ``bob``, ``carol``), by default in the user's
        organization and for the planner and the three backends; ``ttl_s`` in seconds
        (negative: already expired)."""
        organization = organization_id or USERS.get(user, ("acme", ""))[0]
        return mint_dev_token(
            self.dev_secret, user, organization_id=organization, audiences=audiences, ttl_s=ttl_s
        )

    def planner_credential(
        self, audience: str = TRACKER_AUDIENCE, *, subject: str = PLANNER_SERVICE_SUBJECT
    ) -> str:
        """The planner's service credential for one dependency ``audience`` as the planner
        mints it in dev mode (dev service-token issuer, ``sub`` =
        ``PLANNER_SERVICE_SUBJECT``), sent in ``x-ballet-service-authorization``; another
        ``subject`` makes another service's credential, which the backends verify but
        never take for the planner's."""
        return mint_dev_service_token(self.dev_secret, subject, audiences=(audience,))

    async def set_role(self, user: str, project_id: str, role: str | None) -> None:
        """Give ``user`` ``role`` on ``project_id`` (a key of
        ``devstack.auth.ROLE_PERMISSIONS``), or take their role away (None): from the next
        call on, the backends answer as the new role allows (tests of lost access)."""
        await self.store.run_write(
            lambda session: set_role(session, user=user, project_id=project_id, role=role)
        )


class _RecordingServer:
    """The server as ``extra_services`` sees it: everything is passed through, and the
    names of the services registered are noted for reflection and health."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.service_names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        handlers = tuple(handlers)
        for handler in handlers:
            # Generated ``add_*_to_server`` functions register handlers that know their
            # service's name; a bare generic handler may not.
            service_name = getattr(handler, "service_name", None)
            if callable(service_name):
                self.service_names.append(str(service_name()))
        self._server.add_generic_rpc_handlers(handlers)

    def __getattr__(self, name: str) -> object:
        return getattr(self._server, name)
