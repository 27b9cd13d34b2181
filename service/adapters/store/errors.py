"""Database errors, translated in one place (docs/contributing.md).

``translated()`` wraps every unit of work of the store:

- the database cannot be reached, the connection broke, the pool had no connection in
  time, or the database gave up on the transaction (SQLite's "database is locked", a
  PostgreSQL deadlock or serialization failure): ``StoreUnavailable``. Nothing was
  stored, and the caller may retry; unless the connection broke during the commit
  itself, which may have landed (decision 0372).
- a violation of ``uq_turns_one_running``: ``FailedPrecondition``/``TURN_IN_PROGRESS``
  (docs/spec/api-and-streams.md: the loser of the race between two replicas stores nothing).
- a violation of an AIP-155 request-id key: ``RequestIdTaken``, which the repository
  answers by re-reading the original request (a duplicate, or ``REQUEST_ID_REUSED``).
- a NUL character in a text value, which PostgreSQL cannot store:
  ``InvalidArgument``/``NUL_CHARACTER``.
- anything else propagates unchanged: it is a bug, not a condition to handle.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Index, UniqueConstraint
from sqlalchemy import exc as sa_exc

from service.adapters.store.tables import (
    UQ_ONE_RUNNING_TURN,
    UQ_SESSION_REQUEST_ID,
    UQ_TURN_REQUEST_ID,
    metadata,
)
from service.core.errors import FailedPrecondition, InvalidArgument, StoreUnavailable


class RequestIdTaken(Exception):
    """An insert lost the race for an AIP-155 request-id key (``constraint``)."""

    def __init__(self, constraint: str) -> None:
        super().__init__(constraint)
        self.constraint = constraint


@contextmanager
def translated() -> Iterator[None]:
    """Translate database errors raised inside the block (see the module docstring)."""
    try:
        yield
    except sa_exc.IntegrityError as exc:
        name = violated_constraint(exc)
        if name == UQ_ONE_RUNNING_TURN:
            raise FailedPrecondition(
                "another turn is running in this session", reason="TURN_IN_PROGRESS"
            ) from exc
        if name in (UQ_TURN_REQUEST_ID, UQ_SESSION_REQUEST_ID):
            raise RequestIdTaken(name) from exc
        raise
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
        raise StoreUnavailable(f"the database is unavailable: {_first_line(exc)}") from exc
    except sa_exc.DataError as exc:
        # PostgreSQL text cannot hold NUL; a client's id or text with one is bad input,
        # not a failure of the planner (found by the Chat fuzz test).
        if "NUL" in _first_line(exc):
            raise InvalidArgument(
                "text fields cannot contain NUL (U+0000) characters", reason="NUL_CHARACTER"
            ) from exc
        raise
    except sa_exc.DBAPIError as exc:
        if exc.connection_invalidated:
            raise StoreUnavailable(f"the database connection broke: {_first_line(exc)}") from exc
        raise


def violated_constraint(exc: sa_exc.IntegrityError) -> str | None:
    """The name of the unique constraint or index ``exc`` violated, when known.

    PostgreSQL names it in the error's diagnostics. SQLite only lists the columns
    (``UNIQUE constraint failed: turns.session_id``), which identify one unique key of
    this schema (``_SQLITE_UNIQUE_KEYS``).
    """
    diag = getattr(exc.orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    if isinstance(name, str):
        return name
    match = re.search(r"UNIQUE constraint failed: (.+)$", str(exc.orig))
    if match:
        return _SQLITE_UNIQUE_KEYS.get(match.group(1).strip())
    return None


def _sqlite_unique_keys() -> dict[str, str]:
    keys: dict[str, str] = {}
    for table in metadata.tables.values():
        uniques: list[tuple[str, list[str]]] = []
        for index in table.indexes:
            if isinstance(index, Index) and index.unique and index.name:
                uniques.append((str(index.name), [c.name for c in index.columns]))
        for constraint in table.constraints:
            if isinstance(constraint, UniqueConstraint) and constraint.name:
                uniques.append((str(constraint.name), [c.name for c in constraint.columns]))
        for name, columns in uniques:
            keys[", ".join(f"{table.name}.{column}" for column in columns)] = name
    return keys


_SQLITE_UNIQUE_KEYS = _sqlite_unique_keys()


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(orig).__name__
