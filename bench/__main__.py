"""``python -m bench``: run the benchmarks and print the table (see ``bench``).

``python -m bench scale ...`` runs the scale benchmark instead (several replicas on one
durable PostgreSQL, ``bench.scale``), and ``python -m bench idle ...`` the many idle
streams benchmark (``bench.idle``), and ``python -m bench prompt`` counts the fixed
prompt's tokens per part (``bench.prompt``), and ``python -m bench realmodel`` the context
estimate after a compaction against a real llama.cpp server (``bench.realmodel``), and
``python -m bench conversation`` a model call's conversion and encoding of the
conversation, kept against converted every time (``bench.conversation``); ``--help``
after any lists its options.

Options: ``--quick`` (smaller samples and a 10 s idle window instead of 60 s; about two
minutes instead of three and a half), ``--out DIR`` (default ``bench/results``),
``--database-url URL`` (an existing PostgreSQL whose role may create databases, instead
of a throwaway cluster; PostgreSQL's CPU is then not counted), ``--no-profile``,
``--keep`` (keep the work folder and the logs), ``--set TABLE.KEY=VALUE`` (a planner
setting for this run, repeatable).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from bench.context import log
from bench.procs import REPO_ROOT
from bench.report import markdown, write
from bench.runner import Options, run


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller samples, short idle window")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "bench" / "results", help="output folder"
    )
    parser.add_argument("--database-url", help="an existing PostgreSQL (CREATEDB role)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    parser.add_argument(
        "--traced",
        action="store_true",
        help="trace the planner (OTEL_*) into an OTLP sink in the driver",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="a planner setting for this run, e.g. database.pool_size=40 (repeatable)",
    )
    args = parser.parse_args(argv)
    settings = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            parser.error(f"--set {item}: expected TABLE.KEY=VALUE")
        settings.append((key.strip(), value.strip()))
    return Options(
        quick=args.quick,
        out=args.out,
        database_url=args.database_url,
        profile=not args.no_profile,
        keep=args.keep,
        planner_settings=tuple(settings),
        traced=args.traced,
    )


def _terminate(signum: int, frame: object) -> None:
    # Unwind like Ctrl-C, so the children and the throwaway cluster are stopped.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _terminate)
    if args and args[0] == "prompt":
        from bench import prompt

        return prompt.main(args[1:])
    if args and args[0] == "conversation":
        from bench import conversation

        return conversation.main(args[1:])
    if args and args[0] == "realmodel":
        from bench import realmodel

        return realmodel.main(args[1:])
    if args and args[0] in ("scale", "idle"):
        from bench import idle, scale

        return (scale.main if args[0] == "scale" else idle.main)(args[1:])
    options = parse_args(args)
    report = asyncio.run(run(options))
    json_path, md_path = write(report, options.out)
    print(markdown(report))
    log(f"wrote {json_path} and {md_path}")
    missed = [row.key for row in report.rows if row.verdict == "MISSED"]
    if missed:
        log(f"targets missed: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
