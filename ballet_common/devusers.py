"""The dev users of a data directory: the devstack writes who it knows
(``dev-users.json``: user id -> organization id) next to the dev secret when it starts,
so that the chat client, which mints dev tokens from the same folder, can say at once
that ``--user`` or ``--org`` names nobody the devstack knows, and list who it does,
instead of the planner's later ``NOT_FOUND`` for the project. A folder without the file
(a planner served without the devstack) is not checked."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ballet_common.files import create_private_file

#: The file in the data directory.
DEV_USERS_FILE = "dev-users.json"


def write(data_dir: Path, users: Mapping[str, str]) -> None:
    """Record ``users`` (user id -> organization id) in ``data_dir``. Raises ``OSError``."""
    text = json.dumps({"users": dict(sorted(users.items()))}, indent=2) + "\n"
    path = data_dir / DEV_USERS_FILE
    if not create_private_file(path, text.encode()) and path.read_text() != text:
        path.write_text(text)  # an older release's list: the file keeps its 0600


def read(data_dir: Path) -> dict[str, str] | None:
    """The users recorded in ``data_dir``; None when there is no readable record."""
    try:
        value = json.loads((data_dir / DEV_USERS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    users = value.get("users") if isinstance(value, dict) else None
    if not isinstance(users, dict):
        return None
    return {str(user): str(org) for user, org in users.items()}


def mismatch(users: Mapping[str, str], user: str, org: str) -> str:
    """What is wrong with ``user`` in ``org`` given the dev ``users``, as one phrase that
    lists them (``""`` when nothing is): ``no dev user 'mallory'; the devstack has alice,
    bob (organization acme), carol (organization globex); --user names one``."""
    if users.get(user) == org:
        return ""
    by_org: dict[str, list[str]] = {}
    for name, organization in sorted(users.items()):
        by_org.setdefault(organization, []).append(name)
    listed = "; ".join(
        f"{', '.join(names)} (organization {organization})"
        for organization, names in sorted(by_org.items())
    )
    if user not in users:
        return f"no dev user {user!r}; the devstack has {listed}; --user names one"
    return (
        f"dev user {user!r} is in organization {users[user]!r}, not {org!r}; give --org "
        f"{users[user]} (the devstack has {listed})"
    )
