"""Alembic migrations of the planner's schema; run them with ``service.adapters.store.migrate``."""
