"""Fixtures of the polyglot tests: the Node client and nginx (tests/polyglot/support.py).
A missing one skips on a developer's machine and fails in CI (``CI=true`` or
``BALLET_REQUIRE_POLYGLOT=1``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.polyglot.support import ProgramMissing, find_nginx, find_node, polyglot_required


def _program(find: Callable[[], str]) -> str:
    try:
        return find()
    except ProgramMissing as error:
        missing = f"{error} (fails instead of skipping with CI=true or BALLET_REQUIRE_POLYGLOT=1)"
    if polyglot_required():
        pytest.fail(missing, pytrace=False)
    pytest.skip(missing)


@pytest.fixture(scope="session")
def node() -> str:
    """The ``node`` program, with tests/polyglot/node's packages installed."""
    return _program(find_node)


@pytest.fixture(scope="session")
def nginx() -> str:
    """The ``nginx`` program."""
    return _program(find_nginx)
