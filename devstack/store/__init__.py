"""The SQL store behind the devstack's tracker, skills and knowledge backends.

``db`` holds the engine and units of work, ``schema`` the tables, and one module per area
(``access``, ``tracker``, ``skills``, ``knowledge``, ``search``, ``idempotency``) the
queries, as plain async functions over an ``AsyncSession``.
"""

from devstack.store.db import Store, sqlite_url

__all__ = ["Store", "sqlite_url"]
