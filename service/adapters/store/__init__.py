"""SQL storage: the tables, the ``SessionStore`` repository, engines and migrations.

- ``tables``: the schema (SQLAlchemy Core); ``migrations/``: Alembic revisions of it.
- ``engine``: ``make_engine`` for PostgreSQL (psycopg 3) and SQLite (aiosqlite).
- ``repository``: ``SqlSessionStore``, the core's ``SessionStore`` port.
- ``migrate``: ``migrate(url)`` and ``schema_status(...)`` (docs/spec/storage.md).
- ``errors``: the one place database errors are translated.
"""

from service.adapters.store.engine import make_engine
from service.adapters.store.migrate import SchemaStatus, migrate, schema_status
from service.adapters.store.repository import SqlSessionStore

__all__ = ["SchemaStatus", "SqlSessionStore", "make_engine", "migrate", "schema_status"]
