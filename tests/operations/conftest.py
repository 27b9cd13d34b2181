"""Fixtures of the operations tests: the Prometheus programs they run.

A missing ``promtool`` or ``prometheus`` skips these tests on a developer's machine and
fails them in CI (``CI=true``) or with ``BALLET_REQUIRE_PROMETHEUS=1`` (set by .ci/run), so
a CI run can never go green without the rules having been checked and tested.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operations.prom import ToolNotFound, find_tool, prometheus_required


def _tool(name: str) -> Path:
    try:
        return find_tool(name)
    except ToolNotFound as error:
        missing = f"{error} (fails instead of skipping with CI=true or BALLET_REQUIRE_PROMETHEUS=1)"
    if prometheus_required():
        pytest.fail(missing, pytrace=False)
    pytest.skip(missing)


@pytest.fixture(scope="session")
def promtool() -> Path:
    """The ``promtool`` program."""
    return _tool("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> Path:
    """The ``prometheus`` server program."""
    return _tool("prometheus")
