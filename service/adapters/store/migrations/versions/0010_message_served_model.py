"""Messages: the model that answered as the server reported it, and the prompt version of
a summary.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

``served_model`` is, for an assistant answer, the model the model server said answered
(decision 0297; a local server reports the file it loaded, which may differ from the
configured name). ``prompt_version`` is, for a compaction marker (stored with its
summary in one commit), the version of the summary instructions that wrote the summary
(``service/core/prompts``; decision 0294). Both nullable, read as '' when NULL: rows
stored before, and queued messages serialized before, have neither.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for name in ("served_model", "prompt_version"):
        op.add_column("messages", sa.Column(name, sa.Text(), nullable=True))


def downgrade() -> None:
    for name in ("prompt_version", "served_model"):
        op.drop_column("messages", name)
