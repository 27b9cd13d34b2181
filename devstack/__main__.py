"""Run the devstack alone: the planner's dependencies for a ``ballet-planner serve``
pointed at them (README.md).

``python -m devstack [--data-dir D] [--tracker F --project P] [--knowledge DIR]
[--skills DIR] [--database-url URL] [--address HOST:PORT] [--provider scripted|openai]
[--scenario FILE]``

Serves the tracker, skills and knowledge backends and the LLM gateway (over the
``scripted`` demo model, a ``--scenario``, or ``--provider openai``) on one address.
Prints the address, what was loaded, and ready-to-paste ``ballet-planner serve``,
``token`` and ``chat`` lines for the same data directory (whose dev secret both sides
share), then serves until Ctrl-C or SIGTERM. ``ballet-planner dev`` runs the same stack
together with the planner in one process. The ``OTEL_*`` variables trace it as the
planner is traced (service ``ballet-devstack``; ``ballet_common.tracing``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from ballet_common.addresses import split_host_port
from ballet_common.readyfile import remove_ready_file, write_ready_file
from ballet_common.signals import StopSignals, stop_when_signalled
from ballet_common.tokens import Trust, dev_secret
from ballet_common.tracing import Tracing, tracing_from_environment
from devstack.gateway import Provider, add_gateway_service
from devstack.model import (
    OPENAI_MODEL_VARIABLE,
    PROVIDER_HELP,
    PROVIDERS,
    SCENARIO_HELP,
    ProviderName,
    ProviderSetupError,
    make_provider,
    scripted_model_name,
)
from devstack.server import DEFAULT_ADDRESS, DevStack, DevStackConfig, StartupReport

#: The devstack's service name in traces (``OTEL_SERVICE_NAME`` overrides it).
TRACING_SERVICE = "ballet-devstack"
#: Seconds given to exporting the spans still queued at exit (decision 0190).
TRACING_FLUSH_S = 2.0
#: Seconds the stack's calls get to finish at a stop.
STACK_GRACE_S = 1.0
#: The planner's defaults (docs/spec/api-and-streams.md and its settings), to print only what
#: differs.
PLANNER_DATA_DIR = Path(".ballet-dev")
DEPENDENCIES = ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY")


@dataclass(frozen=True)
class Options:
    """The command line: the stack's config and the model behind its gateway."""

    config: DevStackConfig
    provider: ProviderName = "scripted"
    scenario: Path | None = None
    #: Where to write the bound address once serving (``ballet_common.readyfile``).
    ready_file: Path | None = None


def parse_args(argv: list[str] | None = None) -> Options:
    """The options from the command line; argparse exits with a usage error when invalid."""
    parser = argparse.ArgumentParser(
        prog="python -m devstack",
        description="Serve the devstack: tracker, skills and knowledge backends and the LLM "
        "gateway, for a ballet-planner serve pointed at it.",
    )
    parser.add_argument("--data-dir", type=Path, default=PLANNER_DATA_DIR)
    parser.add_argument("--database-url", default=None, help="postgresql+psycopg://...")
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="host:port (port 0: any)")
    parser.add_argument("--tracker", type=Path, default=None, help="a beads issues.jsonl")
    parser.add_argument("--project", default="demo", help="the imported project's id")
    parser.add_argument("--knowledge", type=Path, default=None, help="a folder of ADR files")
    parser.add_argument("--skills", type=Path, default=None, help="a folder of <name>/SKILL.md")
    parser.add_argument("--provider", choices=PROVIDERS, default="scripted", help=PROVIDER_HELP)
    parser.add_argument("--scenario", type=Path, default=None, help=SCENARIO_HELP)
    parser.add_argument(
        "--allow-non-loopback",
        action="store_true",
        help="bind a non-loopback address (plaintext, dev tokens: only on a trusted network)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="once serving, write the bound address there as JSON (for port 0)",
    )
    args = parser.parse_args(argv)
    for name in ("tracker", "knowledge", "skills", "scenario"):
        path = getattr(args, name)
        if path is not None and not path.exists():
            parser.error(f"--{name} {path}: no such file or folder")
    if args.provider == "openai" and args.scenario is not None:
        parser.error("--scenario is for --provider scripted")
    try:
        split_host_port(args.address)
    except ValueError as error:
        parser.error(f"--address: {error}")
    config = DevStackConfig(
        data_dir=args.data_dir,
        database_url=args.database_url,
        address=args.address,
        tracker_file=args.tracker,
        project_id=args.project,
        knowledge_dir=args.knowledge,
        skills_dir=args.skills,
        allow_non_loopback=args.allow_non_loopback,
    )
    return Options(config, args.provider, args.scenario, args.ready_file)


def planner_environment(stack_address: str, data_dir: Path) -> dict[str, str]:
    """The ``BALLET_PLANNER__`` variables a ``serve`` needs to use this stack: none when
    the stack is where the planner looks by default, with the default data directory."""
    env: dict[str, str] = {}
    if data_dir != PLANNER_DATA_DIR:
        env["BALLET_PLANNER__DATA_DIR"] = str(data_dir)
    if stack_address != DEFAULT_ADDRESS:
        for name in DEPENDENCIES:
            env[f"BALLET_PLANNER__DEPENDENCIES__{name}__ADDRESS"] = stack_address
    return env


def banner(
    stack: DevStack,
    options: Options,
    model: str,
    environ: Mapping[str, str] | None = None,
) -> str:
    """What the standalone devstack prints once it serves: what it loaded, and how to
    run the planner, mint tokens and chat against it."""
    config, report = options.config, stack.report
    environ = os.environ if environ is None else environ
    project = config.project_id if config.tracker_file else "demo"
    lines = [f"devstack listening on {stack.address}"]
    lines.append(f"  services: {', '.join(stack.service_names)}")
    lines.append(f"  model: {model}")
    lines.extend(_loaded(report, project))
    env = planner_environment(stack.address, config.data_dir)
    openai_model = environ.get(OPENAI_MODEL_VARIABLE)
    if options.provider == "openai" and openai_model:
        # The planner names the model in every request, and the gateway uses that name.
        env["BALLET_PLANNER__PLANNER__MODEL"] = openai_model
    elif options.provider != "openai":
        # As dev does (decision 0272): the turns, and the chat's model line, name the
        # scripted model that answers, not the planner's default model.
        env["BALLET_PLANNER__PLANNER__MODEL"] = scripted_model_name(options.scenario)
    prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    data = [] if config.data_dir == PLANNER_DATA_DIR else ["--data-dir", str(config.data_dir)]
    lines += [
        "",
        "The planner, in another terminal (same data directory: same dev secret):",
        f"  {prefix + ' ' if prefix else ''}ballet-planner serve",
        "Tokens for alice (all five permissions) and bob (read permissions only):",
        f"  {shlex.join(['ballet-planner', 'token', '--user', 'alice', *data])}",
        f"  {shlex.join(['ballet-planner', 'token', '--user', 'bob', *data])}",
        "Chat, once the planner serves:",
        f"  {shlex.join(['ballet-planner', 'chat', '--project', project, '--user', 'alice'])}"
        + (f" {shlex.join(data)}" if data else ""),
        "Stop with Ctrl-C.",
    ]
    return "\n".join(lines)


def _loaded(report: StartupReport, project: str) -> list[str]:
    lines: list[str] = []
    if report.beads is not None:
        lines.append(
            f"  tracker: {report.beads.items} items imported into {project!r} "
            f"({report.beads.by_kind}), {report.beads.blocks} blocks links"
        )
    else:
        lines.append("  tracker: the built-in demo project 'demo'")
    if report.adrs is not None:
        adrs = report.adrs
        lines.append(
            f"  knowledge: {adrs.created} created, {adrs.updated} updated, "
            f"{adrs.unchanged} unchanged"
        )
    if report.skills is not None:
        lines.append(f"  skills: {report.skills.versions}")
    timings = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in report.timings.items())
    lines.append(f"  loaded in {sum(report.timings.values()):.2f} s ({timings})")
    return lines


async def serve(options: Options) -> int:
    """Start the stack with the gateway, print how to use it, and run until SIGINT or
    SIGTERM; a second signal during the stop skips to its end (decision 0185). Returns
    the exit code: 0, or ``128 + signum`` when a second signal hurried the stop. Raises
    ``ProviderSetupError`` before anything starts when the model cannot be set up."""
    tracing = tracing_from_environment(TRACING_SERVICE)
    provider, model = make_provider(options.provider, options.scenario)
    # The planner proves itself to the gateway with a credential minted from the data
    # directory's dev secret, as it does to the backends (decision 0157).
    trust = Trust.dev(dev_secret(options.config.data_dir))

    def add_gateway(server: grpc.aio.Server) -> None:
        add_gateway_service(server, provider, trust=trust)

    interceptors = (tracing.server_interceptor(),) if tracing is not None else ()
    try:
        try:
            stack = await DevStack.start(
                replace(options.config, extra_services=add_gateway, interceptors=interceptors)
            )
        except OSError as error:
            if options.config.address in str(error):
                # Say what to do, as `ballet-planner dev` does for its --devstack-address.
                raise OSError(f"{error}; choose another with --address") from None
            raise
        with StopSignals("python -m devstack") as signals:
            print(banner(stack, options, model), flush=True)
            stopper = _Stopper(stack, provider, tracing)
            try:
                if options.ready_file is not None:
                    data_dir = str(options.config.data_dir.absolute())
                    write_ready_file(
                        options.ready_file, {"address": stack.address, "data_dir": data_dir}
                    )
                return await stop_when_signalled(
                    signals,
                    stopper.stop,
                    on_stop=lambda signum: print(
                        "python -m devstack: stopping; press Ctrl-C again to stop at once",
                        flush=True,
                    ),
                )
            finally:
                remove_ready_file(options.ready_file)
                await stopper.stop(0 if signals.hurried.is_set() else None)
                print("python -m devstack: stopped", flush=True)
    finally:
        if tracing is not None:
            # Nothing when the stop exported already; after a failed start, what is queued.
            await tracing.shutdown(TRACING_FLUSH_S)


class _Stopper:
    """The devstack's stop: its server (calls get ``STACK_GRACE_S``), the provider's
    connections, then the spans still queued (at most ``TRACING_FLUSH_S``). A second
    call hurries a first in progress: calls are cancelled and the export is cut short
    (decision 0185)."""

    def __init__(self, stack: DevStack, provider: Provider, tracing: Tracing | None) -> None:
        self._stack = stack
        self._provider = provider
        self._tracing = tracing
        self._stopped: asyncio.Future[None] | None = None
        self._flushing = False

    async def stop(self, grace: float | None) -> None:
        if self._stopped is not None:
            if grace is not None and not self._stopped.done():
                await self._stack.stop(0)
                if self._flushing and self._tracing is not None:
                    await self._tracing.shutdown(grace)
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            try:
                await self._stack.stop(STACK_GRACE_S if grace is None else 0)
            finally:
                await _close(self._provider)
                if self._tracing is not None:
                    self._flushing = True
                    flush = TRACING_FLUSH_S if grace is None else min(grace, TRACING_FLUSH_S)
                    await self._tracing.shutdown(flush)
        finally:
            self._stopped.set_result(None)


async def _close(provider: Provider) -> None:
    aclose = getattr(provider, "aclose", None)
    if aclose is not None:
        await aclose()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m devstack``: 0 after Ctrl-C or SIGTERM (130 or 143 when
    a second one cut the stop short); 1 when it cannot start (the model or an address
    cannot be used: one line on stderr), as ``ballet-planner dev`` for the same problem;
    2 for a usage error (argparse)."""
    options = parse_args(argv)
    try:
        return asyncio.run(serve(options))
    except (ProviderSetupError, OSError, ValueError) as error:
        print(f"python -m devstack: cannot start: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C during the start, before the loop handles the signals.
        return 130


if __name__ == "__main__":
    sys.exit(main())
