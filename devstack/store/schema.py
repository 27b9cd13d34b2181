"""The devstack's tables (SQLAlchemy Core), on SQLite or PostgreSQL.

Every table is prefixed ``ds_`` so that the devstack can share a database with the planner
(``ballet-planner dev --database-url``) without a name clash. Times are seconds since the
epoch as doubles: the same on both engines, with no time-zone conversion to get wrong.
Enumerations are stored as lower-case words (``epic``, ``in_progress``); the servicers map
them to the proto enums.

The schema is made with ``metadata.create_all`` (a dev tool; the planner's own tables use
Alembic). Full-text search needs engine-specific objects, added by ``search_ddl``:
an external-content FTS5 table kept in sync by triggers on SQLite, a generated,
GIN-indexed ``tsvector`` column on PostgreSQL (docs/decisions/0103-devstack-hybrid-search.md).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

organizations = sa.Table(
    "ds_organizations",
    metadata,
    sa.Column("org_id", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
)

users = sa.Table(
    "ds_users",
    metadata,
    sa.Column("user_id", sa.String(64), primary_key=True),
    # The organization a dev token for this user names in its ``org`` claim.
    sa.Column("org_id", sa.String(64), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
)

projects = sa.Table(
    "ds_projects",
    metadata,
    sa.Column("project_id", sa.String(64), primary_key=True),
    sa.Column("org_id", sa.String(64), nullable=False, index=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("description", sa.Text, nullable=False, default=""),
    sa.Column("settings", sa.JSON, nullable=False),
)

project_roles = sa.Table(
    "ds_project_roles",
    metadata,
    sa.Column("project_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), primary_key=True, index=True),
    sa.Column("role", sa.String(32), nullable=False),
)

items = sa.Table(
    "ds_items",
    metadata,
    sa.Column("project_id", sa.String(64), primary_key=True),
    sa.Column("item_id", sa.String(128), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column("acceptance_criteria", sa.Text, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("ticket_type", sa.String(32), nullable=False),
    sa.Column("epic_id", sa.String(128), nullable=False),
    sa.Column("milestone_id", sa.String(128), nullable=False),
    # {"mode": str, "settings": {str: str}} or NULL when no human set a policy.
    sa.Column("policy", sa.JSON, nullable=True),
    sa.Column("labels", sa.JSON, nullable=False),
    # Where the row came from (``beads``, ``demo``): importers upsert by (project, id).
    sa.Column("source", sa.String(32), nullable=False),
    sa.Column("create_time", sa.Double, nullable=False),
    sa.Column("update_time", sa.Double, nullable=False),
    sa.Index("ds_items_order", "project_id", "priority", "item_id"),
    sa.Index("ds_items_epic", "project_id", "epic_id"),
    sa.Index("ds_items_milestone", "project_id", "milestone_id"),
)

dependencies = sa.Table(
    "ds_dependencies",
    metadata,
    # ``item_id`` is blocked by ``blocked_by_id``, both in ``project_id``.
    sa.Column("project_id", sa.String(64), primary_key=True),
    sa.Column("item_id", sa.String(128), primary_key=True),
    sa.Column("blocked_by_id", sa.String(128), primary_key=True),
    sa.Index("ds_dependencies_blocker", "project_id", "blocked_by_id"),
)

changesets = sa.Table(
    "ds_changesets",
    metadata,
    # Insertion order: "newest first" with no ties, and a stable keyset for page tokens.
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("changeset_id", sa.String(64), nullable=False, unique=True),
    sa.Column("project_id", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("description", sa.Text, nullable=False),
    # The operations as protobuf JSON (ChangesetOperation, camelCase field names).
    sa.Column("operations", sa.JSON, nullable=False),
    sa.Column("author_id", sa.String(128), nullable=False),
    sa.Column("recorded_by", sa.String(200), nullable=False),
    sa.Column("create_time", sa.Double, nullable=False),
    sa.Index("ds_changesets_project", "project_id", "seq"),
)

idempotency_keys = sa.Table(
    "ds_idempotency_keys",
    metadata,
    # AIP-155 keys: one per (RPC, human, request_id); written in the same transaction as
    # the write they guard, so a concurrent duplicate loses on the primary key.
    sa.Column("method", sa.String(64), primary_key=True),
    sa.Column("human", sa.String(128), primary_key=True),
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("payload_hash", sa.String(64), nullable=False),
    # What the first request produced: a changeset id, or ``<entry_id>@<version>``.
    sa.Column("result_ref", sa.String(200), nullable=False),
    sa.Column("create_time", sa.Double, nullable=False),
)

skills = sa.Table(
    "ds_skills",
    metadata,
    sa.Column("skill_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("org_id", sa.String(64), nullable=False),
    # Empty for an organization skill; a project id for a project skill.
    sa.Column("project_id", sa.String(64), nullable=False),
    sa.Column("name", sa.String(128), nullable=False),
    sa.UniqueConstraint("org_id", "project_id", "name", name="ds_skills_name"),
)

skill_versions = sa.Table(
    "ds_skill_versions",
    metadata,
    sa.Column("skill_id", sa.Integer, primary_key=True),
    sa.Column("version", sa.String(32), primary_key=True),
    # The version's numbers, so "latest" is a numeric, not a string, maximum.
    sa.Column("major", sa.Integer, nullable=False),
    sa.Column("minor", sa.Integer, nullable=False),
    sa.Column("patch", sa.Integer, nullable=False),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column("content", sa.Text, nullable=False),
    sa.Column("content_sha256", sa.String(64), nullable=False),
    sa.Column("create_time", sa.Double, nullable=False),
)

skill_pins = sa.Table(
    "ds_skill_pins",
    metadata,
    sa.Column("project_id", sa.String(64), primary_key=True),
    sa.Column("skill_id", sa.Integer, primary_key=True),
    sa.Column("version", sa.String(32), nullable=False),
)

knowledge_entries = sa.Table(
    "ds_knowledge_entries",
    metadata,
    sa.Column("entry_id", sa.String(64), primary_key=True),
    sa.Column("org_id", sa.String(64), nullable=False, index=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("status", sa.String(64), nullable=False),
    sa.Column("project_ids", sa.JSON, nullable=False),
    sa.Column("item_ids", sa.JSON, nullable=False),
    sa.Column("author_id", sa.String(128), nullable=False),
    sa.Column("recorded_by", sa.String(200), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("create_time", sa.Double, nullable=False),
    sa.Column("update_time", sa.Double, nullable=False),
    # The import source (``adr:0004``) for imported entries, NULL for created ones.
    sa.Column("source_id", sa.String(200), nullable=True, unique=True),
)

knowledge_versions = sa.Table(
    "ds_knowledge_versions",
    metadata,
    # Every version of every entry, so an idempotent replay returns what the first
    # request returned even after later updates (AIP-155).
    sa.Column("entry_id", sa.String(64), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("status", sa.String(64), nullable=False),
    sa.Column("project_ids", sa.JSON, nullable=False),
    sa.Column("item_ids", sa.JSON, nullable=False),
    sa.Column("recorded_by", sa.String(200), nullable=False),
    sa.Column("update_time", sa.Double, nullable=False),
)

knowledge_supersessions = sa.Table(
    "ds_knowledge_supersessions",
    metadata,
    # ``entry_id`` supersedes ``supersedes_id``.
    sa.Column("entry_id", sa.String(64), primary_key=True),
    sa.Column("supersedes_id", sa.String(64), primary_key=True, index=True),
)

search_docs = sa.Table(
    "ds_search_docs",
    metadata,
    sa.Column("doc_id", sa.Integer, primary_key=True, autoincrement=True),
    # ``item`` (ref ``<project>/<item>``), ``skill`` (ref ``<skill_id>@<version>``) or
    # ``knowledge`` (ref = entry id).
    sa.Column("doc_type", sa.String(16), nullable=False),
    sa.Column("ref_id", sa.String(300), nullable=False),
    sa.Column("org_id", sa.String(64), nullable=False),
    sa.Column("project_id", sa.String(64), nullable=False),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.UniqueConstraint("doc_type", "ref_id", name="ds_search_docs_ref"),
    sa.Index("ds_search_docs_scope", "org_id", "doc_type", "project_id"),
)

_SQLITE_SEARCH = (
    # Porter stemming so "blocking" finds "blocked"; unicode61 folds case and diacritics.
    "CREATE VIRTUAL TABLE IF NOT EXISTS ds_search_fts USING fts5("
    "title, body, content='ds_search_docs', content_rowid='doc_id', "
    "tokenize='porter unicode61')",
    "CREATE TRIGGER IF NOT EXISTS ds_search_docs_ai AFTER INSERT ON ds_search_docs BEGIN "
    "INSERT INTO ds_search_fts(rowid, title, body) VALUES (new.doc_id, new.title, new.body); "
    "END",
    "CREATE TRIGGER IF NOT EXISTS ds_search_docs_ad AFTER DELETE ON ds_search_docs BEGIN "
    "INSERT INTO ds_search_fts(ds_search_fts, rowid, title, body) "
    "VALUES ('delete', old.doc_id, old.title, old.body); END",
    "CREATE TRIGGER IF NOT EXISTS ds_search_docs_au AFTER UPDATE ON ds_search_docs BEGIN "
    "INSERT INTO ds_search_fts(ds_search_fts, rowid, title, body) "
    "VALUES ('delete', old.doc_id, old.title, old.body); "
    "INSERT INTO ds_search_fts(rowid, title, body) VALUES (new.doc_id, new.title, new.body); "
    "END",
)

_POSTGRES_SEARCH = (
    # Title words weigh more (A) than body words (B) in ts_rank.
    "ALTER TABLE ds_search_docs ADD COLUMN IF NOT EXISTS tsv tsvector GENERATED ALWAYS AS ("
    "setweight(to_tsvector('english', title), 'A') || "
    "setweight(to_tsvector('english', body), 'B')) STORED",
    "CREATE INDEX IF NOT EXISTS ds_search_docs_tsv ON ds_search_docs USING gin (tsv)",
)


def search_ddl(dialect: str) -> tuple[str, ...]:
    """The statements that add full-text search to ``ds_search_docs`` on ``dialect``.

    Idempotent (``IF NOT EXISTS``), so they run after every ``create_all``. Raises
    ``ValueError`` for an engine other than ``sqlite`` and ``postgresql``.
    """
    if dialect == "sqlite":
        return _SQLITE_SEARCH
    if dialect == "postgresql":
        return _POSTGRES_SEARCH
    raise ValueError(f"the devstack runs on SQLite or PostgreSQL, not {dialect}")
