"""The planner's version: the installed distribution's (``pyproject.toml``'s
``project.version``), shown by ``ballet-planner --version`` and the
``ballet_planner_build_info`` metric."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "ballet-planner"
#: Reported when the code runs from a source tree that was never installed.
UNKNOWN = "0+unknown"


def version() -> str:
    """The installed version, e.g. ``0.1.0``; ``UNKNOWN`` outside an installation."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN
