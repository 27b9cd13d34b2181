"""Sessions: the running context estimate holds tokens, not UTF-8 bytes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

The estimate of what was stored since the last reported usage is now counted in tokens
by the calibrated estimator (``service/core/estimate.py``; decision 0171), which counts
CJK text and code far better than bytes / 4, so ``context_pending_bytes`` becomes
``context_pending_tokens``. Existing rows are converted the way they were read before,
one token per four bytes rounded up; the next answer that reports usage replaces them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _rename(old: str, new: str) -> None:
    # RENAME COLUMN keeps the table, its indexes and the partial ones' conditions, on
    # PostgreSQL and on SQLite (3.25 and later); a batch copy would rebuild the table.
    op.execute(sa.text(f"ALTER TABLE sessions RENAME COLUMN {old} TO {new}"))


def upgrade() -> None:
    _rename("context_pending_bytes", "context_pending_tokens")
    op.execute(
        sa.text("UPDATE sessions SET context_pending_tokens = (context_pending_tokens + 3) / 4")
    )


def downgrade() -> None:
    op.execute(sa.text("UPDATE sessions SET context_pending_tokens = context_pending_tokens * 4"))
    _rename("context_pending_tokens", "context_pending_bytes")
