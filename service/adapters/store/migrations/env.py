"""Alembic's environment for the planner's migrations.

There is no ``alembic.ini``: ``service.adapters.store.migrate`` builds the configuration
in code and hands this script an open connection in ``config.attributes["connection"]``
(Alembic runs synchronously, inside ``AsyncConnection.run_sync``). The ``alembic``
command line is not supported; use ``ballet-planner migrate``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from service.adapters.store.tables import metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite alters tables by copying them; later revisions need batch mode there.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    if context.is_offline_mode():
        raise RuntimeError("offline (--sql) migrations are not supported")
    connection = context.config.attributes.get("connection")
    if not isinstance(connection, Connection):
        raise RuntimeError(
            "run the planner's migrations through service.adapters.store.migrate "
            "(ballet-planner migrate), which passes the connection"
        )
    _run(connection)


_main()
