"""Run the devstack backends alone, for manual testing (SPEC section 9).

``python -m devstack --data-dir D [--tracker F --project P] [--knowledge DIR]
[--skills DIR] [--database-url URL] [--address HOST:PORT]``

Prints the address, what was loaded and how to mint a token, then serves until Ctrl-C
or SIGTERM. ``ballet-planner dev`` runs the same stack together with the planner.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from devstack.server import DEFAULT_ADDRESS, DevStack, DevStackConfig


def parse_args(argv: list[str] | None = None) -> DevStackConfig:
    """The config from the command line; argparse exits with a usage error when invalid."""
    parser = argparse.ArgumentParser(
        prog="python -m devstack", description="Serve the devstack tracker, skills and knowledge."
    )
    parser.add_argument("--data-dir", type=Path, default=Path(".ballet-dev"))
    parser.add_argument("--database-url", default=None, help="postgresql+psycopg://...")
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="host:port (port 0: any)")
    parser.add_argument("--tracker", type=Path, default=None, help="a beads issues.jsonl")
    parser.add_argument("--project", default="demo", help="the imported project's id")
    parser.add_argument("--knowledge", type=Path, default=None, help="a folder of ADR files")
    parser.add_argument("--skills", type=Path, default=None, help="a folder of <name>/SKILL.md")
    parser.add_argument(
        "--allow-non-loopback",
        action="store_true",
        help="bind a non-loopback address (plaintext, dev tokens: only on a trusted network)",
    )
    args = parser.parse_args(argv)
    for name in ("tracker", "knowledge", "skills"):
        path = getattr(args, name)
        if path is not None and not path.exists():
            parser.error(f"--{name} {path}: no such file or folder")
    return DevStackConfig(
        data_dir=args.data_dir,
        database_url=args.database_url,
        address=args.address,
        tracker_file=args.tracker,
        project_id=args.project,
        knowledge_dir=args.knowledge,
        skills_dir=args.skills,
        allow_non_loopback=args.allow_non_loopback,
    )


async def serve(config: DevStackConfig) -> None:
    """Start the stack, print how to use it, and run until SIGINT or SIGTERM."""
    stack = await DevStack.start(config)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    report = stack.report
    project = config.project_id if config.tracker_file else "demo"
    lines = [f"devstack listening on {stack.address}"]
    lines.append(f"  services: {', '.join(stack.service_names)}")
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
    lines.append(
        '  token: python -c "from pathlib import Path; '
        "from ballet_common.tokens import dev_secret, mint_dev_token; "
        f"print(mint_dev_token(dev_secret(Path('{config.data_dir}')), 'alice'))\""
    )
    print("\n".join(lines), flush=True)
    try:
        await stopping.wait()
    finally:
        await stack.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m devstack``."""
    config = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
