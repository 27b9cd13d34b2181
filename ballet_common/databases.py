"""What a database URL names, said to a human: the planner's commands and the devstack
print one line when a database cannot be reached, naming what was tried (never the
password) and the driver's reason."""

from __future__ import annotations

from sqlalchemy.engine import make_url


def database_target(url: str) -> str:
    """Where ``url`` (a SQLAlchemy URL) points, for a human and without its password:
    ``postgresql://bob@db.example:5432/planner`` (the driver left out, the default port
    named; every host of a multi-host URL, comma-separated) or ``the SQLite file
    PATH``."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return f"the SQLite file {parsed.database or ':memory:'}"
    user = f"{parsed.username}@" if parsed.username else ""
    hosts = parsed.query.get("host")
    if hosts:
        # A multi-host URL (``?host=a:5432&host=b:6432``): every host, in the order tried.
        listed = [hosts] if isinstance(hosts, str) else list(hosts)
        where = ",".join(h if ":" in h else f"{h}:5432" for h in listed)
    else:
        host = parsed.host or "localhost"
        host = f"[{host}]" if ":" in host else host
        where = f"{host}:{parsed.port or 5432}"
    return f"{parsed.get_backend_name()}://{user}{where}/{parsed.database or ''}"


def unreachable(url: str, error: BaseException) -> str:
    """One line for a database at ``url`` that could not be used because of ``error``
    (a ``StoreUnavailable``, possibly wrapping the driver's error): what was tried and
    the driver's reason, e.g. ``cannot connect to postgresql://bob@127.0.0.1:5432/planner
    (connection refused)``."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    # psycopg: 'connection failed: connection to server at "h", port 1 failed: Why'.
    reason = first.rsplit(" failed: ", 1)[-1].removeprefix("FATAL:").strip()
    return f"cannot connect to {database_target(url)} ({reason[:1].lower() + reason[1:]})"
