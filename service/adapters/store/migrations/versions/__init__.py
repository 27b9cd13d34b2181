"""Alembic revisions, oldest first (each file names its ``down_revision``)."""
