"""Sessions followed by each replica, so that a commit signals only where someone listens.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

Decision 0340: a replica's notifier records the sessions it follows (a Chat stream of
it is attached there) as rows of ``session_follows``, in the statement that starts or
stops listening to them; a commit reads the other replicas' rows of its session in its
own round trip and sends its cross-replica signal only when there is one. A replica that
is forgotten (its lease swept, or its orderly stop) takes its rows with it. Written out
in full, like 0001, so it keeps creating the schema of its day.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "session_follows",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("replica_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "replica_id", name="pk_session_follows"),
    )
    op.create_index("ix_session_follows_replica_id", "session_follows", ["replica_id"])


def downgrade() -> None:
    op.drop_table("session_follows")
