"""Open Chat streams counted across replicas: replica heartbeats and stream rows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

docs/spec/limits.md limits a human to 16 open Chat streams across replicas;
docs/decisions/0080-cross-replica-stream-count.md explains the design. Written out in
full, like 0001, so it keeps creating the schema of its day.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "planner_replicas",
        sa.Column("replica_id", sa.Text(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("replica_id", name="pk_planner_replicas"),
    )
    op.create_table(
        "chat_streams",
        sa.Column("stream_id", sa.Text(), nullable=False),
        sa.Column("human_id", sa.Text(), nullable=False),
        sa.Column("replica_id", sa.Text(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["replica_id"],
            ["planner_replicas.replica_id"],
            name="fk_chat_streams_replica_id_planner_replicas",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("stream_id", name="pk_chat_streams"),
    )
    op.create_index("ix_chat_streams_human_id", "chat_streams", ["human_id"])
    op.create_index("ix_chat_streams_replica_id", "chat_streams", ["replica_id"])


def downgrade() -> None:
    op.drop_table("chat_streams")
    op.drop_table("planner_replicas")
