"""``ballet-planner dev``: the command line of the devstack and the planner together.
Registered on the ``ballet-planner`` command through the entry point group
``ballet_planner.commands`` of this distribution (``ballet-devstack``), so the planner's
own distribution knows nothing of it; cheap to import (``devstack.dev`` is imported when
it runs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from ballet_common import datadir
from devstack.defaults import DEFAULT_ADDRESS as DEVSTACK_ADDRESS
from devstack.defaults import PLANNER_ADDRESS


def add_dev(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``dev`` on ``ballet-planner``'s subcommands (the entry point of group
    ``ballet_planner.commands``)."""
    parser = commands.add_parser(
        "dev",
        help="run the devstack and the planner together",
        description="Run the devstack (tracker, skills, knowledge, LLM gateway) and the "
        "planner in one process on loopback; print how to connect; run until Ctrl-C.",
    )
    parser.add_argument("--config", type=Path, help="planner TOML file ([planner] included)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="state of both (default: $BALLET_PLANNER__DATA_DIR, the file's, or ./.ballet-dev)",
    )
    parser.add_argument(
        "--database-url", help="postgresql+psycopg://... for both (default: SQLite files)"
    )
    parser.add_argument("--tracker", type=Path, help="a beads issues.jsonl to import")
    parser.add_argument(
        "--project", default="demo", help="id of the imported project (default demo)"
    )
    parser.add_argument("--knowledge", type=Path, help="a folder of ADR markdown files")
    parser.add_argument("--skills", type=Path, help="a folder of <name>/SKILL.md")
    parser.add_argument(
        "--provider",
        choices=("scripted", "openai"),
        default="scripted",
        help="the model: scripted (default) or openai (BALLET_OPENAI_BASE_URL, "
        "BALLET_OPENAI_API_KEY, BALLET_OPENAI_MODEL)",
    )
    parser.add_argument(
        "--scenario", type=Path, help="scripted scenario JSON (default: the built-in demo)"
    )
    parser.add_argument(
        "--address", help=f"planner host:port (default: server.address, {PLANNER_ADDRESS})"
    )
    parser.add_argument(
        "--devstack-address",
        default=DEVSTACK_ADDRESS,
        help="devstack host:port (default 127.0.0.1:50052; port 0: any free port)",
    )
    parser.add_argument(
        "--metrics-address",
        help="planner metrics host:port (default: server.metrics_address, "
        "BALLET_PLANNER__SERVER__METRICS_ADDRESS, else 127.0.0.1:9464; port 0: any free "
        "port; empty: off)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="logs on stderr: text (the default on a terminal) or json (the default "
        "otherwise, and whenever logging.format is set)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="once ready, write the bound addresses, data directory and project there as "
        "JSON (for port 0); removed at the stop",
    )
    parser.set_defaults(handler=dev)


#: The flag of ``dev`` for each planner setting a start can fail on.
SETTING_FLAGS = {
    "server.address": "--address",
    "server.metrics_address": "--metrics-address",
    "database.url": "--database-url",
}


def log_format(asked: str | None, config_file: Path | None, environ: dict[str, str]) -> str | None:
    """The log format ``dev`` overrides ``logging.format`` with: ``asked`` (the flag);
    else ``text`` when stderr is a terminal and neither the environment nor the file set
    it (the banner, not JSON, is what a person reads there); else None (the settings')."""
    if asked is not None:
        return asked
    if "BALLET_PLANNER__LOGGING__FORMAT" in environ or not sys.stderr.isatty():
        return None
    if config_file is not None:
        import tomllib

        try:
            with config_file.open("rb") as handle:
                table = tomllib.load(handle).get("logging", {})
        except (OSError, tomllib.TOMLDecodeError):
            return None  # loading the settings says what is wrong with it
        if isinstance(table, dict) and "format" in table:
            return None
    return "text"


def quiet_start_loggers(level: str) -> None:
    """Keep the schema migration's lines (Alembic, one per revision) at DEBUG: below that
    level they would scroll the banner out of sight."""
    import logging

    if level != "DEBUG":
        logging.getLogger("alembic").setLevel(logging.WARNING)


def dev(args: argparse.Namespace) -> int:
    """Run ``ballet-planner dev``; returns the exit code (0, 130/143 after a second stop
    signal, 1 when it cannot start, 2 for a usage problem)."""
    for name in ("config", "tracker", "knowledge", "skills", "scenario"):
        path = getattr(args, name)
        if path is not None and not path.exists():
            print(f"ballet-planner dev: --{name} {path}: no such file or folder", file=sys.stderr)
            return 2
    if args.tracker is None and args.project != "demo":
        print(
            "ballet-planner dev: --project names an imported project: give --tracker too",
            file=sys.stderr,
        )
        return 2
    if args.provider == "openai" and args.scenario is not None:
        print("ballet-planner dev: --scenario is for --provider scripted", file=sys.stderr)
        return 2
    from devstack.dev import DevError, DevOptions, dev_settings, hold_data_dir, run_dev
    from service.server.logs import configure_logging
    from service.server.root import StartupError

    options = DevOptions(
        config_file=args.config,
        data_dir=args.data_dir,
        database_url=args.database_url,
        tracker_file=args.tracker,
        project_id=args.project,
        knowledge_dir=args.knowledge,
        skills_dir=args.skills,
        provider=args.provider,
        scenario=args.scenario,
        address=args.address,
        devstack_address=args.devstack_address,
        metrics_address=args.metrics_address,
        log_format=log_format(args.log_format, args.config, dict(os.environ)),
        ready_file=args.ready_file,
    )
    settings = dev_settings(options)
    try:
        # Checked, not created: a start that fails later leaves no folder behind.
        datadir.check_folder(settings.data_dir, datadir.WITH_OPTION)
    except datadir.DataDirError as error:
        print(f"ballet-planner dev: cannot start: {error}", file=sys.stderr)
        return 1
    held = hold_data_dir(settings.data_dir)
    if isinstance(held, str):
        print(f"ballet-planner dev: cannot start: {held}", file=sys.stderr)
        return 1
    configure_logging(settings.logging)
    quiet_start_loggers(settings.logging.level)
    try:
        return asyncio.run(run_dev(options, settings))
    except DevError as error:
        print(f"ballet-planner dev: cannot start: {error}", file=sys.stderr)
        return 1
    except StartupError as error:
        flag = SETTING_FLAGS.get(error.setting)
        with_flag = f"; with dev: {flag}" if flag else ""
        print(f"ballet-planner dev: cannot start: {error}{with_flag}", file=sys.stderr)
        return 1
