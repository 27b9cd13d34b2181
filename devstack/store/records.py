"""Plain values the store returns; the servicers turn them into protobuf messages.

Enumerations are lower-case words, as stored: item kinds ``milestone``/``epic``/``ticket``,
item states ``open``/``in_progress``/``blocked``/``closed``, changeset statuses
``proposed``/``applied``/``rejected``, knowledge kinds ``document``/``decision``/``note``/
``debt``, skill scopes ``organization``/``project``. Times are seconds since the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ITEM_KINDS = ("milestone", "epic", "ticket")
ITEM_STATES = ("open", "in_progress", "blocked", "closed")
CHANGESET_STATUSES = ("proposed", "applied", "rejected")
KNOWLEDGE_KINDS = ("document", "decision", "note", "debt")


@dataclass(frozen=True)
class ProjectRecord:
    """A project with its organization and settings (``planner.skill``, ...)."""

    project_id: str
    name: str
    description: str
    organization_id: str
    organization_name: str
    settings: dict[str, str]


@dataclass(frozen=True)
class Access:
    """A human's view of a project: the project and the permissions their role grants."""

    project: ProjectRecord
    permissions: frozenset[str]


@dataclass(frozen=True)
class Policy:
    """An execution policy: a mode (``manual``, ``auto``) and settings."""

    mode: str
    settings: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ItemRecord:
    """A milestone, epic or ticket with its dependencies in both directions."""

    project_id: str
    item_id: str
    kind: str
    title: str
    description: str
    acceptance_criteria: str
    state: str
    priority: int
    ticket_type: str
    epic_id: str
    milestone_id: str
    blocked_by_ids: tuple[str, ...]
    blocks_ids: tuple[str, ...]
    policy: Policy | None
    labels: tuple[str, ...]
    create_time: float
    update_time: float


@dataclass(frozen=True)
class ItemPage:
    """One page of items: ``items``, whether more follow, and the filter's total count."""

    items: list[ItemRecord]
    more: bool
    total: int


@dataclass(frozen=True)
class ChangesetRecord:
    """A changeset; ``operations`` is protobuf JSON of ``ChangesetOperation`` messages."""

    changeset_id: str
    project_id: str
    status: str
    title: str
    description: str
    operations: list[dict[str, Any]]
    author_id: str
    recorded_by: str
    create_time: float
    seq: int


@dataclass(frozen=True)
class SkillView:
    """A skill as one project sees it: the version it resolves (pin, else latest)."""

    name: str
    description: str
    scope: str
    version: str
    pinned: bool
    latest_version: str
    skill_id: int
    content: str = field(default="", repr=False)


@dataclass(frozen=True)
class KnowledgeRecord:
    """A knowledge entry (or one of its versions, for idempotent replays)."""

    entry_id: str
    organization_id: str
    kind: str
    title: str
    body: str
    status: str
    supersedes_ids: tuple[str, ...]
    superseded_by_ids: tuple[str, ...]
    project_ids: tuple[str, ...]
    item_ids: tuple[str, ...]
    author_id: str
    recorded_by: str
    version: int
    create_time: float
    update_time: float


@dataclass(frozen=True)
class SearchHit:
    """A project search hit: an item or a skill, its fused score and a snippet."""

    score: float
    snippet: str
    item: ItemRecord | None = None
    skill: SkillView | None = None


@dataclass(frozen=True)
class KnowledgeHit:
    """A knowledge search hit: the entry, its score and a snippet."""

    entry: KnowledgeRecord
    score: float
    snippet: str
