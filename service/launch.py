"""The ``ballet-planner`` console script: ``service.cli.main``, imported from here so
that a Ctrl-C while the program is still loading its modules ends it as one a moment
later does: quietly, exit 130."""

from __future__ import annotations


def main() -> int:
    """``service.cli.main()``; 130 when interrupted while importing it."""
    try:
        from service.cli import main as run
    except KeyboardInterrupt:
        return 130
    return run()
