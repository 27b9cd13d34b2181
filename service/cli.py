"""The ``ballet-planner`` command: the front door of the planner's programs.

The server's own subcommands live here: ``serve`` (the production service), ``migrate``
(bring the database schema to this release), ``token`` (a dev JWT from the data
directory's secret), ``health`` (readiness and liveness probe) and ``purge`` (one
retention pass, or the erasure of one human: docs/retention.md). The other programs
add theirs through the entry point group ``ballet_planner.commands`` (a function that
registers a subparser): ``chat``, the terminal client (``ballet_chat.command``, in this
distribution), and ``dev``, the devstack with the planner (``devstack.command``, in the
``ballet-devstack`` distribution, which a production image does not contain: there
``dev`` says how to install it). Each subcommand is one ``_add_<name>`` function
registering its parser and handler, so adding one touches nothing else.

Exit codes: 0 success; 1 a failed check or command (``health`` not SERVING); 2 a usage or
configuration error, with a message on stderr naming the problem; for ``serve`` and
``dev``, 130 (SIGINT) or 143 (SIGTERM) when a second signal cut the shutdown short
(``ballet_common.signals``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path

from ballet_common import datadir, devusers
from ballet_common.tokens import DEFAULT_DEV_TOKEN_TTL_S
from service.config import ConfigError, Settings, is_loopback, load_settings, split_address

Handler = Callable[[argparse.Namespace], int]

DEFAULT_ADDRESS = "127.0.0.1:50051"
#: The entry point group through which other programs add subcommands.
COMMANDS_GROUP = "ballet_planner.commands"
#: Subcommands other distributions provide, and how to get each when it is missing.
OPTIONAL_COMMANDS = {
    "dev": (
        "run the devstack and the planner together (needs the devstack)",
        "the devstack is not installed here (a production image leaves it out); from a "
        "checkout of the repository: pip install ./devstack",
    ),
}


#: The names the planner's health service answers for: overall readiness, the API's
#: readiness, liveness (``service.server.root``).
HEALTH_SERVICES = ("", "ballet.planner.v1.PlannerService", "liveness")
#: The longest a health check waits for its answer (seconds): a probe, not a watch.
MAX_HEALTH_TIMEOUT_S = 3600.0


def _settings(config: Path | None, **overrides: str) -> Settings:
    environ = dict(os.environ)
    for key, value in overrides.items():
        environ[f"BALLET_PLANNER__{key}"] = value
    return load_settings(config, environ)


# --------------------------------------------------------------------------- serve


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve", help="run the planner service", description="Run the planner gRPC service."
    )
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    _add_database_url(parser)
    _add_ready_file(parser)
    parser.set_defaults(handler=_serve)


def _add_database_url(parser: argparse.ArgumentParser) -> None:
    """``--database-url`` and ``--data-dir``: the flags of every subcommand that opens the
    planner's database (serve, migrate, purge; dev has the same two, for both halves)."""
    parser.add_argument("--database-url", help="SQLAlchemy URL (overrides database.url)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="data directory: the SQLite database and dev secret (overrides data_dir; "
        "default ./.ballet-dev)",
    )


def _add_ready_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="once serving, write the bound addresses there as JSON (for port 0); removed "
        "at the stop",
    )


def _database_overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides = {"DATABASE__URL": args.database_url} if args.database_url else {}
    if args.data_dir is not None:
        overrides["DATA_DIR"] = str(args.data_dir)
    return overrides


def _how_to_choose(args: argparse.Namespace) -> str:
    """What a data directory's error says to do: name ``--data-dir`` when it was given."""
    return datadir.WITH_OPTION if args.data_dir is not None else datadir.HOW_TO_CHOOSE


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args.config, **_database_overrides(args))
    from service.server.logs import configure_logging
    from service.server.root import StartupError
    from service.server.serving import event_loop_runner, serve

    if args.data_dir is not None:
        # Given on the command line: its problem is named by the flag, before anything
        # starts (the planner would name the setting).
        try:
            datadir.check_folder(settings.data_dir, datadir.WITH_OPTION)
        except datadir.DataDirError as error:
            print(f"ballet-planner: cannot start: {error}", file=sys.stderr)
            return 1

    configure_logging(settings.logging)
    try:
        # 0, or 128 + the signal's number when a second one cut the shutdown short.
        return event_loop_runner(settings.server.event_loop)(serve(settings, args.ready_file))
    except StartupError as error:
        flag = "; with serve: --database-url" if error.setting == "database.url" else ""
        given = flag if args.database_url else ""
        print(f"ballet-planner: cannot start: {error}{given}", file=sys.stderr)
        return 1


# --------------------------------------------------------------------------- migrate


def _add_migrate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "migrate",
        help="upgrade the database schema",
        description="Upgrade the database schema to this release (run as a job before "
        "serving on PostgreSQL).",
    )
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    _add_database_url(parser)
    parser.set_defaults(handler=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    settings = _settings(args.config, **_database_overrides(args))
    from ballet_common.databases import unreachable
    from service.adapters.store import migrate, schema_status
    from service.core.errors import StoreUnavailable

    if settings.database.is_sqlite:
        try:
            datadir.prepare(settings.data_dir, _how_to_choose(args))
        except datadir.DataDirError as error:
            print(f"ballet-planner migrate: {error}", file=sys.stderr)
            return 1
    try:
        asyncio.run(
            migrate(settings.database.url, connect_timeout_s=settings.database.connect_timeout_s)
        )
        status = asyncio.run(schema_status(settings.database.url))
    except StoreUnavailable as error:
        where = "--database-url" if args.database_url else "database.url"
        print(
            f"ballet-planner migrate: {unreachable(settings.database.url, error)}; is the "
            f"database running there, and is {where} right?",
            file=sys.stderr,
        )
        return 1
    print(f"database schema at {status.current} (head {status.head})")
    return 0


# --------------------------------------------------------------------------- token


def _add_token(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "token",
        help="print a dev token",
        description="Print a dev JWT for a user, signed with the data directory's dev "
        "secret, which the planner (serve or dev) creates at its first start. Dev mode only.",
    )
    parser.add_argument("--user", required=True, help="the subject (human id)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="data directory (default: $BALLET_PLANNER__DATA_DIR or ./.ballet-dev)",
    )
    parser.add_argument(
        "--ttl",
        type=float,
        default=DEFAULT_DEV_TOKEN_TTL_S,
        help=f"lifetime in seconds (default {DEFAULT_DEV_TOKEN_TTL_S:.0f}: 12 hours; at most "
        "2592000: 30 days)",
    )
    parser.add_argument(
        "--scope",
        action="append",
        default=[],
        help="a scope (repeatable); makes a service principal, e.g. planner.sessions.read",
    )
    parser.add_argument("--org", default="acme", help="organization id (default acme)")
    parser.add_argument(
        "--create-secret",
        action="store_true",
        help="create the data directory's dev secret if it has none (a planner already "
        "running on that directory will not accept the tokens)",
    )
    parser.set_defaults(handler=_token)


def _known_scopes() -> frozenset[str]:
    from service.core.sessions import READ_SCOPE

    return frozenset({READ_SCOPE})


def _token(args: argparse.Namespace) -> int:
    from ballet_common.tokens import (
        MAX_DEV_TOKEN_TTL_S,
        PLANNER_AUDIENCE,
        DevSecretError,
        dev_secret,
        mint_dev_service_token,
        mint_dev_token,
    )

    data_dir = datadir.chosen(args.data_dir)
    if not args.user.strip():
        print("ballet-planner token: --user must name someone", file=sys.stderr)
        return 2
    # NaN fails both comparisons; inf and 1e30 the second (decision 0168).
    if not 0 < args.ttl <= MAX_DEV_TOKEN_TTL_S:
        return _usage_error(
            "token",
            "--ttl must be a number of seconds above 0 and at most "
            f"{MAX_DEV_TOKEN_TTL_S:.0f} (30 days)",
        )
    scopes = [scope for value in args.scope for scope in value.split()]
    unknown = sorted(set(scopes) - _known_scopes())
    if unknown:
        # The planner grants nothing for another scope: a token with one is a mistake.
        print(
            f"ballet-planner token: unknown scope {', '.join(unknown)}; the planner knows "
            f"{', '.join(sorted(_known_scopes()))}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.create_secret:
            datadir.prepare(data_dir, datadir.WITH_OPTION)
        datadir.check_folder(data_dir, datadir.WITH_OPTION)
        # A secret made here signs tokens that no running planner accepts, so it is only
        # made when asked for.
        secret = dev_secret(data_dir, create=args.create_secret)
    except (datadir.DataDirError, DevSecretError) as error:
        print(f"ballet-planner token: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError:
        print(
            f"ballet-planner token: no dev secret in {data_dir}: start the planner "
            "(`ballet-planner serve` or `dev`) with this data directory first, or pass "
            "--create-secret to make one",
            file=sys.stderr,
        )
        return 2
    except OSError as error:
        print(
            "ballet-planner token: "
            + str(datadir.unusable(data_dir, error, "read the dev secret", datadir.WITH_OPTION)),
            file=sys.stderr,
        )
        return 2
    if scopes:
        # Service principals come from the service-token issuer, never a human's token.
        token = mint_dev_service_token(
            secret,
            args.user,
            audiences=(PLANNER_AUDIENCE,),
            scopes=scopes,
            organization_id=args.org,
            ttl_s=args.ttl,
        )
    else:
        # The devstack's users, when it recorded them: a token of nobody it knows would
        # only be refused later as a project not found.
        users = devusers.read(data_dir)
        mismatch = devusers.mismatch(users, args.user, args.org) if users is not None else ""
        if mismatch:
            print(f"ballet-planner token: {mismatch}", file=sys.stderr)
            return 2
        token = mint_dev_token(secret, args.user, organization_id=args.org, ttl_s=args.ttl)
    print(token)
    return 0


def _usage_error(command: str, message: str) -> int:
    """Say ``message`` on stderr as ``ballet-planner COMMAND``'s; the exit code of a
    usage error (2)."""
    print(f"ballet-planner {command}: {message}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- health


def _add_health(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "health",
        help="check the service's health",
        description="Ask grpc.health.v1 Check. Exit 0 when SERVING (readiness); with "
        "--alive, 0 on any answer (liveness); 1 otherwise.",
    )
    parser.add_argument(
        "--address",
        help="host:port (default: server.address from --config or the environment, else "
        f"{DEFAULT_ADDRESS}; a wildcard host is asked on loopback)",
    )
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--alive", action="store_true", help="exit 0 on any answer")
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help=f"seconds (default 5, at most {MAX_HEALTH_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--service",
        default="",
        help='service name (default "": overall; also '
        + ", ".join(name for name in HEALTH_SERVICES if name)
        + ")",
    )
    parser.add_argument(
        "--tls-ca", type=Path, help="CA bundle of the server's certificate (enables TLS)"
    )
    parser.set_defaults(handler=_health)


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # The same settings as serve (file and environment), so a probe given only the
    # environment asks the address and TLS the server uses.
    # NaN fails both comparisons; inf would wait forever.
    if not 0 < args.timeout <= MAX_HEALTH_TIMEOUT_S:
        return _usage_error(
            "health",
            f"--timeout must be a number of seconds above 0 and at most {MAX_HEALTH_TIMEOUT_S:.0f}",
        )
    settings = _settings(args.config)
    address = args.address or settings.server.address
    host, port = split_address(address, "--address")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    ca_file = args.tls_ca
    use_tls = ca_file is not None
    if settings.server.tls_cert is not None:
        use_tls = True
        ca_file = ca_file or settings.server.tls_ca or settings.server.tls_cert
    if use_tls:
        try:
            roots = ca_file.read_bytes() if ca_file is not None else None
        except OSError as error:
            return _usage_error(
                "health", f"cannot read the CA bundle {ca_file}: {error.strerror or error}"
            )
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots))
    else:
        if not is_loopback(host):
            print(f"ballet-planner health: asking {target} in plaintext", file=sys.stderr)
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as error:
            code = error.code()
            answered = code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if args.alive and answered:
                print(f"alive ({code.name})")
                return 0
            if code == grpc.StatusCode.NOT_FOUND:
                print(
                    f"ballet-planner health: {target} has no health service {args.service!r}; "
                    f"--service names one of: {', '.join(repr(n) for n in HEALTH_SERVICES)}",
                    file=sys.stderr,
                )
                return 1
            hint = ""
            if code == grpc.StatusCode.UNAVAILABLE:
                hint = "; is `ballet-planner dev` (or serve) running there? (--address)"
            print(
                f"ballet-planner health: {target}: {code.name}: {error.details()}{hint}",
                file=sys.stderr,
            )
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING or args.alive:
        print(status)
        return 0
    print(f"ballet-planner health: {target}: {status}", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- purge


def _add_purge(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "purge",
        help="delete idle sessions, or everything of one human",
        description="Delete the sessions idle for retention.session_idle_days days with "
        "everything in them (one pass of serve's retention job, e.g. in a CronJob), or with "
        "--human ID all of one human's (an erasure request); see docs/retention.md. Exit 0: "
        "done (or a pass runs elsewhere); 1: the database is unusable or missing, an "
        "erasure is incomplete, or the counts could not be pushed (--pushgateway); 2: a "
        "usage or configuration error.",
    )
    parser.add_argument("--config", type=Path, help="TOML configuration file (as for serve)")
    _add_database_url(parser)
    parser.add_argument("--human", metavar="ID", help="erase this human (their tokens' sub)")
    parser.add_argument("--dry-run", action="store_true", help="count only; delete nothing")
    parser.add_argument("--json", action="store_true", help="print the outcome as one JSON line")
    parser.add_argument(
        "--pushgateway",
        metavar="URL",
        help="push what was deleted to this Prometheus Pushgateway (job ballet-planner-purge)",
    )
    parser.set_defaults(handler=_purge)


def _purge(args: argparse.Namespace) -> int:
    import json
    from datetime import UTC, datetime

    from service.server import retention

    settings = _settings(args.config, **_database_overrides(args))
    if args.human is not None and not args.human.strip():
        print("ballet-planner purge: --human must name someone", file=sys.stderr)
        return 2
    if args.human is None and not settings.retention.session_idle_days:
        print(
            "ballet-planner purge: retention is off (retention.session_idle_days is 0): set "
            "it, e.g. BALLET_PLANNER__RETENTION__SESSION_IDLE_DAYS=90, to delete idle "
            "sessions, or give --human ID for an erasure",
            file=sys.stderr,
        )
        return 2
    request = retention.PurgeRequest(args.human, args.dry_run)
    try:
        report = asyncio.run(retention.run_purge(settings, request))
    except retention.PurgeError as error:
        print(f"ballet-planner purge: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(retention.report_json(report)))
    else:
        print("\n".join(retention.report_lines(report, settings.retention.session_idle_days)))
    if not retention.report_complete(report):
        return 1
    try:
        if args.pushgateway:
            retention.push_purge_metrics(args.pushgateway, report, datetime.now(UTC))
    except OSError as error:
        gateway = args.pushgateway
        print(
            f"ballet-planner purge: done, but the push to {gateway} failed: {error}",
            file=sys.stderr,
        )
        return 1
    return 0


# --------------------------------------------------------------------------- main

#: The server's own subcommands, in help order.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    _add_serve,
    _add_migrate,
    _add_token,
    _add_health,
    _add_purge,
)


def _add_missing(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    broken: tuple[ImportError, str] | None,
) -> None:
    summary, how = OPTIONAL_COMMANDS[name]
    if broken is not None and not _missing_module(*broken):
        how = f"it is installed but cannot be loaded ({broken[0]})"

    def missing(_args: argparse.Namespace) -> int:
        print(f"ballet-planner {name}: {how}", file=sys.stderr)
        return 2

    parser = commands.add_parser(name, help=summary, add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(handler=missing)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand: the server's, then those the
    installed programs register (``COMMANDS_GROUP``), then a stand-in for each optional
    one that is not installed."""
    from service.version import version

    parser = argparse.ArgumentParser(
        prog="ballet-planner", description="Ballet Planner: the conversational planning service."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(subcommands=commands.choices)
    for add in SUBCOMMANDS:
        add(commands)
    registered: set[str] = set()
    broken: dict[str, tuple[ImportError, str]] = {}
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            add = entry.load()
        except ImportError as error:
            # A program whose metadata outlived its code (or that cannot import): the
            # stand-in below says so when it is asked for; the rest still works.
            broken[entry.name] = (error, entry.module)
            continue
        add(commands)
        registered.add(entry.name)
    for name in sorted(OPTIONAL_COMMANDS.keys() - registered):
        _add_missing(commands, name, broken.get(name))
    return parser


def _missing_module(error: ImportError, module: str) -> bool:
    """Whether ``error``, raised loading ``module``, says its package is absent (not
    broken)."""
    missing = (error.name or "") if isinstance(error, ModuleNotFoundError) else ""
    return missing.partition(".")[0] == module.partition(".")[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ballet-planner`` with ``argv`` (default: the process's); returns the exit
    code. Configuration errors print ``configuration error: <key>: <problem>``, exit 2."""
    try:
        parser = build_parser()
        words = list(sys.argv[1:] if argv is None else argv)
        if all(word.startswith("-") for word in words):
            # No command: argparse would only say that COMMAND is missing, not that an
            # option it was given is unknown.
            unknown = [word for word in words if word not in ("-h", "--help", "--version")]
            if unknown:
                parser.error(
                    f"unrecognized arguments: {' '.join(unknown)}; give a COMMAND first "
                    "(`ballet-planner --help` lists them)"
                )
        args, unknown = parser.parse_known_args(words)
        if unknown:
            # argparse leaves a subcommand's unknown options to the top-level parser,
            # whose usage does not name them: the subcommand's own usage does.
            args.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
        handler: Handler = args.handler
        return handler(args)
    except ConfigError as error:
        print(f"ballet-planner: configuration error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Also while the subcommands load (a Ctrl-C right after the command is typed).
        return 130
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """The exit code when whoever read the output left (``| head``): 1, as ``chat``'s,
    without a traceback; output still buffered goes nowhere, so flushing it at exit
    raises nothing either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


if __name__ == "__main__":
    sys.exit(main())
