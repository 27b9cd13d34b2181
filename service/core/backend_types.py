"""What the tool backends hold, as the core sees it: the values of the ``ToolBackends``
port (``service/core/ports.py``).

Items, changesets and their operations (tracker), skills (skills), knowledge entries and
search hits (knowledge), the requests that ask for them, and whom a call acts for. Our
own types, not the backends' messages: ``service/adapters/backends.py`` translates them
to and from ``ballet.tracker.v1``, ``ballet.skills.v1`` and ``ballet.knowledge.v1``, and
the tools (``service/core/tools/``) shape them into what the model reads.

Values coming from a backend are what it sent, normalized at the adapter: an enum number
this planner does not know is ``UNSPECIFIED``, a sub-message it left out is an empty
value, a time is an aware UTC ``datetime`` (None when unset or not a calendar time), a
score is a finite float. Requests hold what the planner sends; the adapter refuses a
number the backend's field cannot hold (``ToolFailure``/``INVALID_ARGUMENTS``, naming the
field) rather than let it fail in the wire encoding.

No I/O and no grpc, protobuf or SQLAlchemy here (docs/contributing.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

# --------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class Acting:
    """Whom a backend call acts for (docs/spec/authority.md).

    Every call carries ``token`` (the human's bearer token), ``x-ballet-actor:
    planner:<session_id>`` and the planner's own service credential.
    """

    human_id: str
    organization_id: str
    token: str
    session_id: str

    @property
    def actor(self) -> str:
        """The recorded actor, ``planner:<session_id>``."""
        return f"planner:{self.session_id}"


@dataclass(frozen=True)
class ProjectInfo:
    """A project as the system prompt shows it, with its planner settings."""

    project_id: str
    name: str
    description: str
    organization_id: str
    organization_name: str
    planner_skill: str
    model_credential: str
    permissions: frozenset[str] = frozenset()


# --------------------------------------------------------------------------- tracker


class ItemKind(StrEnum):
    """A plan item's kind (``ballet.tracker.v1.ItemKind``)."""

    UNSPECIFIED = "unspecified"
    MILESTONE = "milestone"
    EPIC = "epic"
    TICKET = "ticket"


class ItemState(StrEnum):
    """A plan item's state (``ballet.tracker.v1.ItemState``)."""

    UNSPECIFIED = "unspecified"
    OPEN = "open"
    IN_PROGRESS = "in_progress"
    BLOCKED = "blocked"
    CLOSED = "closed"


@dataclass(frozen=True)
class ExecutionPolicy:
    """How an agent may execute an item; only humans set it (docs/spec/authority.md)."""

    mode: str
    settings: Mapping[str, str]


@dataclass(frozen=True)
class Item:
    """A milestone, epic or ticket. List RPCs fill the compact fields; ``GetItem`` also
    the description, acceptance criteria, dependencies, policy and times."""

    item_id: str
    kind: ItemKind
    title: str
    state: ItemState
    priority: int
    ticket_type: str = ""
    epic_id: str = ""
    milestone_id: str = ""
    labels: tuple[str, ...] = ()
    description: str = ""
    acceptance_criteria: str = ""
    blocked_by_ids: tuple[str, ...] = ()
    blocks_ids: tuple[str, ...] = ()
    policy: ExecutionPolicy | None = None
    create_time: datetime | None = None
    update_time: datetime | None = None


@dataclass(frozen=True)
class ItemQuery:
    """``ListItems``: one page of a project's items; a None or empty filter is none."""

    project_id: str
    page_size: int
    kind: ItemKind | None = None
    state: ItemState | None = None
    epic_id: str = ""
    milestone_id: str = ""
    page_token: str = ""


@dataclass(frozen=True)
class RunnableQuery:
    """``ListRunnableTickets``: one page of the open tickets whose blockers are closed."""

    project_id: str
    page_size: int
    page_token: str = ""


@dataclass(frozen=True)
class ItemPage:
    """A page of items; ``total_size`` 0 means the backend did not say (proto3)."""

    items: tuple[Item, ...]
    next_page_token: str = ""
    total_size: int = 0


@dataclass(frozen=True)
class ProjectSearch:
    """``SearchProject``: at most ``limit`` items and skills matching ``query``."""

    project_id: str
    query: str
    limit: int


@dataclass(frozen=True)
class SkillMention:
    """A skill found by project search."""

    name: str
    description: str
    version: str


@dataclass(frozen=True)
class ProjectHit:
    """One project search hit: an item or a skill (a hit with neither is dropped by the
    adapter), its score (higher is better) and a snippet."""

    score: float
    snippet: str
    item: Item | None = None
    skill: SkillMention | None = None


@dataclass(frozen=True)
class ProjectSearchResult:
    """Project search hits, best first, and which halves were searched: items need
    ``tracker.read``, skills ``skill.read`` (docs/spec/authority.md)."""

    hits: tuple[ProjectHit, ...]
    items_searched: bool
    skills_searched: bool


class ChangesetStatus(StrEnum):
    """A changeset's status (``ballet.tracker.v1.ChangesetStatus``)."""

    UNSPECIFIED = "unspecified"
    PROPOSED = "proposed"
    APPLIED = "applied"
    REJECTED = "rejected"


@dataclass(frozen=True)
class CreateItem:
    """Create an item; ``ref`` names it for later operations of the same changeset.

    There is no policy field: the planner cannot set execution policies (docs/spec/authority.md), so
    no value of this type can carry one to the tracker.
    """

    kind: ItemKind
    title: str
    priority: int
    ref: str = ""
    description: str = ""
    acceptance_criteria: str = ""
    ticket_type: str = ""
    epic_id: str = ""
    milestone_id: str = ""


@dataclass(frozen=True)
class UpdateItem:
    """Change an item's fields; None leaves a field as it is. No policy (see
    ``CreateItem``)."""

    item_id: str
    title: str | None = None
    description: str | None = None
    acceptance_criteria: str | None = None
    state: ItemState | None = None
    priority: int | None = None
    epic_id: str | None = None
    milestone_id: str | None = None


@dataclass(frozen=True)
class DependencyChange:
    """Add (or, with ``remove``, remove) "``item_id`` is blocked by ``blocked_by_id``"."""

    item_id: str
    blocked_by_id: str
    remove: bool = False


#: One operation of a changeset. An operation of a kind this planner does not know is
#: dropped by the adapter.
ChangesetOperation = CreateItem | UpdateItem | DependencyChange


@dataclass(frozen=True)
class Changeset:
    """A proposed set of plan changes that a human applies or rejects."""

    changeset_id: str
    status: ChangesetStatus
    title: str
    description: str
    author_id: str
    recorded_by: str
    operations: tuple[ChangesetOperation, ...]
    create_time: datetime | None = None


@dataclass(frozen=True)
class ChangesetQuery:
    """``ListChangesets``: one page of a project's changesets, newest first."""

    project_id: str
    page_size: int
    status: ChangesetStatus | None = None
    page_token: str = ""


@dataclass(frozen=True)
class ChangesetPage:
    """A page of changesets."""

    changesets: tuple[Changeset, ...]
    next_page_token: str = ""


@dataclass(frozen=True)
class ChangesetProposal:
    """``ProposeChangeset``; ``request_id`` is the planner's id of the tool call, so a
    repeated request returns the first changeset (AIP-155; docs/spec/authority.md)."""

    request_id: str
    project_id: str
    title: str
    description: str
    operations: tuple[ChangesetOperation, ...]


# --------------------------------------------------------------------------- skills


class SkillScope(StrEnum):
    """Where a skill is defined (``ballet.skills.v1.SkillScope``)."""

    UNSPECIFIED = "unspecified"
    ORGANIZATION = "organization"
    PROJECT = "project"


@dataclass(frozen=True)
class Skill:
    """A skill as the project resolves it: ``version`` is the one it uses (pins
    applied), ``latest_version`` the newest."""

    name: str
    description: str
    scope: SkillScope
    version: str
    pinned: bool
    latest_version: str


@dataclass(frozen=True)
class SkillQuery:
    """``ListSkills``: one page of the project's effective skills."""

    project_id: str
    page_size: int
    page_token: str = ""


@dataclass(frozen=True)
class SkillPage:
    """A page of skills."""

    skills: tuple[Skill, ...]
    next_page_token: str = ""


@dataclass(frozen=True)
class SkillDocument:
    """A skill's SKILL.md in the version the project resolves (for the system prompt)."""

    name: str
    version: str
    content: str


@dataclass(frozen=True)
class SkillContent:
    """A skill and its SKILL.md in the version the project resolves (for the
    ``read_skill`` tool)."""

    skill: Skill
    content: str


# --------------------------------------------------------------------------- knowledge


class KnowledgeKind(StrEnum):
    """A knowledge entry's kind (``ballet.knowledge.v1.KnowledgeKind``)."""

    UNSPECIFIED = "unspecified"
    DOCUMENT = "document"
    DECISION = "decision"
    NOTE = "note"
    DEBT = "debt"


@dataclass(frozen=True)
class KnowledgeEntry:
    """An entry of the organization's knowledge base. Search hits fill the head; reads
    and writes also the body, the supersession links and the times."""

    entry_id: str
    kind: KnowledgeKind
    title: str
    status: str
    version: int
    author_id: str
    recorded_by: str
    project_ids: tuple[str, ...] = ()
    item_ids: tuple[str, ...] = ()
    body: str = ""
    supersedes_ids: tuple[str, ...] = ()
    superseded_by_ids: tuple[str, ...] = ()
    create_time: datetime | None = None
    update_time: datetime | None = None


@dataclass(frozen=True)
class KnowledgeSearch:
    """``SearchKnowledge``: at most ``limit`` entries of the organization; an empty query
    lists the newest."""

    query: str
    limit: int
    kind: KnowledgeKind | None = None


@dataclass(frozen=True)
class KnowledgeHit:
    """One knowledge search hit: the entry's head, its score and a snippet."""

    entry: KnowledgeEntry
    score: float
    snippet: str


@dataclass(frozen=True)
class KnowledgeHits:
    """Knowledge search hits, best first."""

    hits: tuple[KnowledgeHit, ...]
    next_page_token: str = ""


@dataclass(frozen=True)
class NewKnowledgeEntry:
    """``CreateKnowledgeEntry``, linked to ``project_id`` and ``item_ids``;
    ``request_id`` as in ``ChangesetProposal``."""

    request_id: str
    project_id: str
    kind: KnowledgeKind
    title: str
    body: str
    status: str = ""
    item_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class KnowledgeEntryChange:
    """``UpdateKnowledgeEntry`` of the entry at ``version`` (the one read); None leaves a
    field as it is, and ``item_ids`` set (even empty) replaces the linked items."""

    request_id: str
    entry_id: str
    version: int
    title: str | None = None
    body: str | None = None
    status: str | None = None
    item_ids: tuple[str, ...] | None = None
