"""Session rules: who may see and change which session, pagination, project checks.

The unary session RPCs (docs/spec/api-and-streams.md) and the Chat ``open`` call these; the
transport converts requests and results, nothing more. No grpc, protobuf or SQLAlchemy here
(docs/contributing.md).

Authority (docs/spec/authority.md):

- A session belongs to one project and to the human who created it. Only that human may
  chat in it or change it (``SendMessage``, ``CancelTurn``, ``UpdateSession``,
  ``DeleteSession``, Chat). Anyone else gets ``NotFound``/``SESSION_NOT_FOUND``, so
  existence never leaks.
- A service principal (a token of the service-token issuer, ``Caller.service``; never a
  human token that names a scope) with ``planner.sessions.read`` may ``Get*`` and
  ``List*`` every session of its token's organization; it never chats or changes a
  session (``PermissionDenied``/``HUMAN_REQUIRED``). Without the scope it gets
  ``PermissionDenied``/``MISSING_SCOPE``.
- Creating a session asks the tracker, as the human, whether the project exists and the
  human may read it. Every other use of a session by a human (each session RPC, Chat
  ``open``, ``send_message`` and ``cancel_turn``) re-checks it: a human who lost access
  to the project gets ``NotFound``/``PROJECT_NOT_FOUND``. Answers are reused for at most
  ``auth.project_check_cache_s`` (<= 60 s) per (organization, human, project)
  (docs/decisions/0151-access-rechecked-on-every-read.md).
- Identifiers quoted in errors are cut to ``ECHO_MAX_CHARS``; an id longer than
  ``ID_MAX_CHARS`` cannot exist and is not looked up.

Pagination follows AIP-158: ``page_size`` 0 means the default, larger values are capped,
negative ones are ``InvalidArgument``/``INVALID_PAGE_SIZE``; page tokens are opaque and
authenticated (``service.core.pages``; docs/decisions/0152-authenticated-page-tokens.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from service.core.client_copy import CLIENT_MESSAGE_MAX_BYTES, message_for_client
from service.core.errors import HumanRequired, InvalidArgument, NotFound, PermissionDenied, echo
from service.core.ids import new_session_id
from service.core.model import Message, Session, Turn
from service.core.pages import PageTokens, bad_page_token
from service.core.ports import (
    Acting,
    Clock,
    NewSession,
    ProjectInfo,
    SessionCursor,
    SessionQuery,
    SessionStore,
)
from service.core.projects import ProjectDirectory

#: The scope that lets a service principal read sessions of its organization
#: (docs/spec/authority.md).
READ_SCOPE = "planner.sessions.read"
#: AIP-155 request ids are at most 64 characters (docs/spec/api-and-streams.md).
REQUEST_ID_MAX_CHARS = 64
TITLE_MAX_CHARS = 256
#: ListSessions: 0 means 50; at most 100 (proto ``ListSessionsRequest.page_size``).
SESSIONS_PAGE_DEFAULT = 50
SESSIONS_PAGE_MAX = 100
#: ListMessages: 0 means 100; at most 1,000 (proto ``ListMessagesRequest.page_size``).
MESSAGES_PAGE_DEFAULT = 100
MESSAGES_PAGE_MAX = 1000
#: Bytes a message adds to a ListMessages page beyond its text fields: ids, numbers,
#: timestamps and protobuf framing (an over-estimate; the transport passes an exact
#: sizer).
MESSAGE_OVERHEAD_BYTES = 256
#: Longest session, turn or project id looked up at all: longer ones cannot exist (the
#: planner's ids are UUIDs; Core's project ids are short), so they are not found without
#: a query or a tracker call.
ID_MAX_CHARS = 256
#: Largest sequence a page token may hold (PostgreSQL bigint).
MAX_SEQUENCE = 2**63 - 1
#: Longest ``create_time`` text a ListSessions page token may hold (ISO 8601).
_TIME_MAX_CHARS = 64


@dataclass(frozen=True)
class Caller:
    """The verified caller of an RPC (docs/spec/authority.md).

    ``subject`` is the human id, or a service's name for a service principal;
    ``service`` is True only for a token of the service-token issuer (proven by its
    keys, docs/decisions/0150-service-principals.md), and only then do ``scopes`` count;
    ``token`` is the raw bearer token, forwarded when acting for the human;
    ``expires_at`` its ``exp`` in seconds since the epoch (open streams check it).
    """

    subject: str
    organization_id: str
    service: bool = False
    scopes: frozenset[str] = frozenset()
    token: str = field(default="", repr=False)
    expires_at: float = math.inf

    def expired(self, now: float) -> bool:
        """True once the token's ``exp`` has passed at ``now`` (seconds since the epoch;
        no leeway)."""
        return now >= self.expires_at

    @property
    def is_service(self) -> bool:
        """True for a service principal (proven by its token's issuer, not by a claim)."""
        return self.service

    @property
    def may_read_sessions(self) -> bool:
        """True for a service principal with ``planner.sessions.read``."""
        return self.service and READ_SCOPE in self.scopes

    def acting(self, session_id: str = "") -> Acting:
        """The human as backend calls act for them, recorded as ``planner:<session>``."""
        return Acting(
            human_id=self.subject,
            organization_id=self.organization_id,
            token=self.token,
            session_id=session_id,
        )


@dataclass(frozen=True)
class SessionLimits:
    """What the session rules take from the settings.

    ``page_max_bytes``: most bytes of one ListMessages page (``limits.page_max_bytes``);
    ``client_message_max_bytes``: a message larger than this is listed truncated
    (``limits.client_message_max_bytes``; ``service.core.client_copy``). How long a
    project check is reused and its deadline belong to the ``ProjectDirectory``.
    """

    page_max_bytes: int = 1024 * 1024
    client_message_max_bytes: int = CLIENT_MESSAGE_MAX_BYTES


@dataclass(frozen=True)
class SessionPage:
    """One page of ``ListSessions``; ``next_page_token`` is empty on the last page."""

    sessions: list[Session]
    next_page_token: str


@dataclass(frozen=True)
class MessagePage:
    """One page of ``ListMessages``; ``next_page_token`` is empty on the last page."""

    messages: list[Message]
    next_page_token: str


# --------------------------------------------------------------------------- pages


def page_size_of(requested: int, default: int, maximum: int) -> int:
    """AIP-158 page size: 0 -> ``default``, capped at ``maximum``; negative raises
    ``InvalidArgument``/``INVALID_PAGE_SIZE``."""
    if requested < 0:
        raise InvalidArgument(
            f"page_size must not be negative, got {requested}", reason="INVALID_PAGE_SIZE"
        )
    return default if requested == 0 else min(requested, maximum)


def estimated_message_bytes(message: Message) -> int:
    """An over-estimate of a message's encoded size: its text fields plus overhead."""
    return (
        message.size_bytes()
        + len(message.session_id)
        + len(message.turn_id)
        + len(message.message_id)
        + len(message.tool_call_id)
        + len(message.human_id.encode())
        + MESSAGE_OVERHEAD_BYTES
    )


# --------------------------------------------------------------------------- project checks


class ProjectAccess:
    """Whether a human may read a project, asked of the tracker as that human
    (docs/spec/authority.md), through the process's one ``ProjectDirectory``: positive
    answers are reused as long as the directory keeps them (at most 60 s per
    organization, human and project); refusals are never reused, so a new permission
    works at once.
    """

    def __init__(self, directory: ProjectDirectory) -> None:
        self._directory = directory

    async def check(self, caller: Caller, project_id: str, session_id: str = "") -> ProjectInfo:
        """The project, if ``caller`` (a human) may read it in their organization.

        Raises ``NotFound``/``PROJECT_NOT_FOUND`` (unknown, unreadable, or in another
        organization), and passes on the backend's ``Unavailable`` and
        ``Unauthenticated``.
        """
        if len(project_id) > ID_MAX_CHARS:
            raise _project_not_found(project_id)
        try:
            project = await self._directory.project(caller.acting(session_id), project_id)
        except NotFound:
            raise _project_not_found(project_id) from None
        if project.organization_id and project.organization_id != caller.organization_id:
            raise _project_not_found(project_id)
        return project


def _project_not_found(project_id: str) -> NotFound:
    return NotFound(
        f"project {echo(project_id)!r} does not exist or you may not read it",
        reason="PROJECT_NOT_FOUND",
        metadata={"project_id": echo(project_id)},
    )


# --------------------------------------------------------------------------- the rules


def _session_not_found(session_id: str) -> NotFound:
    return NotFound(
        f"session {echo(session_id)!r} not found",
        reason="SESSION_NOT_FOUND",
        metadata={"session_id": echo(session_id)},
    )


def _require(value: str, name: str) -> None:
    if not value:
        raise InvalidArgument(f"{name} is required", reason=f"{name.upper()}_REQUIRED")


def check_request_id(request_id: str, *, required: bool) -> None:
    """AIP-155 request id: at most 64 characters; ``required`` on create and send.

    Raises ``InvalidArgument``/``REQUEST_ID_REQUIRED`` or ``REQUEST_ID_TOO_LONG``.
    """
    if not request_id:
        if required:
            raise InvalidArgument("request_id is required", reason="REQUEST_ID_REQUIRED")
        return
    if len(request_id) > REQUEST_ID_MAX_CHARS:
        raise InvalidArgument(
            f"request_id is longer than {REQUEST_ID_MAX_CHARS} characters",
            reason="REQUEST_ID_TOO_LONG",
        )


def _check_title(title: str) -> None:
    if len(title) > TITLE_MAX_CHARS:
        raise InvalidArgument(
            f"title is longer than {TITLE_MAX_CHARS} characters", reason="TITLE_TOO_LONG"
        )


def _missing_scope() -> PermissionDenied:
    return PermissionDenied(f"the token lacks the {READ_SCOPE} scope", reason="MISSING_SCOPE")


def _human_required() -> HumanRequired:
    return HumanRequired("only the session's owner may do this; service principals may only read")


class SessionRules:
    """The session use cases behind the unary RPCs and Chat ``open``.

    ``page_tokens`` makes and checks the page tokens of both lists; ``message_size``
    measures a message for the ListMessages byte cap (default:
    ``estimated_message_bytes``); ``new_id`` makes session ids. Every method raises
    ``PlannerError`` subclasses (mapped by ``service/transport/errors.py``) and passes on
    ``StoreUnavailable``.
    """

    def __init__(
        self,
        store: SessionStore,
        projects: ProjectAccess,
        clock: Clock,
        limits: SessionLimits,
        *,
        page_tokens: PageTokens,
        message_size: Callable[[Message], int] = estimated_message_bytes,
        new_id: Callable[[], str] = new_session_id,
    ) -> None:
        self._store = store
        self._pages = page_tokens
        self._projects = projects
        self._clock = clock
        self._limits = limits
        self._message_size = message_size
        self._new_id = new_id

    # -- access ------------------------------------------------------------------

    async def readable_session(self, caller: Caller, session_id: str) -> Session:
        """The session if ``caller`` may read it: its owner, who may still read the
        session's project (re-checked, cached), or a service principal with
        ``planner.sessions.read`` in its organization.

        Raises ``InvalidArgument``/``SESSION_ID_REQUIRED``, ``NotFound``
        (``SESSION_NOT_FOUND``; ``PROJECT_NOT_FOUND`` for an owner who lost access to the
        project), ``PermissionDenied``/``MISSING_SCOPE``, and passes on the tracker's
        ``Unavailable``.
        """
        _require(session_id, "session_id")
        if caller.is_service and not caller.may_read_sessions:
            raise _missing_scope()
        session = await self._stored_session(session_id)
        if session is None or session.organization_id != caller.organization_id:
            raise _session_not_found(session_id)
        if not caller.is_service:
            if session.owner_id != caller.subject:
                raise _session_not_found(session_id)
            await self.recheck_project(caller, session)
        return session

    async def owned_session(self, caller: Caller, session_id: str) -> Session:
        """The session if ``caller`` is the human who owns it and may still read its
        project (re-checked, cached): for chatting and changing it.

        Raises ``InvalidArgument``/``SESSION_ID_REQUIRED``, ``PermissionDenied``/
        ``HUMAN_REQUIRED`` for service principals, ``NotFound`` (``SESSION_NOT_FOUND``,
        ``PROJECT_NOT_FOUND``), and passes on the tracker's ``Unavailable``.
        """
        _require(session_id, "session_id")
        if caller.is_service:
            raise _human_required()
        session = await self._stored_session(session_id)
        if (
            session is None
            or session.owner_id != caller.subject
            or session.organization_id != caller.organization_id
        ):
            raise _session_not_found(session_id)
        await self.recheck_project(caller, session)
        return session

    async def _stored_session(self, session_id: str) -> Session | None:
        # An id no session can have is not looked up (and never reaches the database).
        if len(session_id) > ID_MAX_CHARS:
            return None
        return await self._store.get_session(session_id)

    async def recheck_project(self, caller: Caller, session: Session) -> ProjectInfo | None:
        """Re-check that a human caller may still read the session's project (cached at
        most 60 s; docs/spec/authority.md), for a session already read with ``owned_session`` or
        ``readable_session``. Service principals are not re-checked: None. Raises
        ``NotFound``/``PROJECT_NOT_FOUND``."""
        if caller.is_service:
            return None
        return await self._projects.check(caller, session.project_id, session.session_id)

    # -- use cases ---------------------------------------------------------------

    async def create_session(
        self, caller: Caller, *, request_id: str, project_id: str, title: str
    ) -> Session:
        """``CreateSession``: a session of ``caller`` in a project they may read.

        Idempotent on (human, ``request_id``) (AIP-155): the same request returns the
        session created first; the same id with another payload raises
        ``InvalidArgument``/``REQUEST_ID_REUSED`` (from the store). Raises
        ``InvalidArgument`` (``REQUEST_ID_REQUIRED``, ``REQUEST_ID_TOO_LONG``,
        ``PROJECT_ID_REQUIRED``, ``TITLE_TOO_LONG``), ``PermissionDenied``/
        ``HUMAN_REQUIRED``, ``NotFound``/``PROJECT_NOT_FOUND``, ``Unavailable``.
        """
        check_request_id(request_id, required=True)
        _require(project_id, "project_id")
        _check_title(title)
        if caller.is_service:
            raise _human_required()
        session_id = self._new_id()
        project = await self._projects.check(caller, project_id, session_id)
        payload = json.dumps([project_id, title], separators=(",", ":"))
        return await self._store.create_session(
            NewSession(
                session_id=session_id,
                project_id=project_id,
                organization_id=project.organization_id or caller.organization_id,
                owner_id=caller.subject,
                title=title,
                request_id=request_id,
                request_hash=hashlib.sha256(payload.encode()).hexdigest(),
                now=self._clock.now(),
            )
        )

    async def get_session(self, caller: Caller, session_id: str) -> Session:
        """``GetSession``, with the summary and its ``up_to``."""
        return await self.readable_session(caller, session_id)

    async def list_sessions(
        self, caller: Caller, *, project_id: str, page_size: int, page_token: str
    ) -> SessionPage:
        """``ListSessions`` of one project, newest first, ties by id (docs/spec/api-and-streams.md).

        A human sees their own sessions, while they may still read the project
        (re-checked, cached); a service principal with the read scope sees every session
        of the project in its organization. Raises ``InvalidArgument``
        (``PROJECT_ID_REQUIRED``, ``INVALID_PAGE_SIZE``, ``INVALID_PAGE_TOKEN``),
        ``NotFound``/``PROJECT_NOT_FOUND`` and ``PermissionDenied``/``MISSING_SCOPE``.
        """
        _require(project_id, "project_id")
        size = page_size_of(page_size, SESSIONS_PAGE_DEFAULT, SESSIONS_PAGE_MAX)
        if caller.is_service and not caller.may_read_sessions:
            raise _missing_scope()
        owner = None if caller.is_service else caller.subject
        query = {
            "project_id": project_id,
            "organization_id": caller.organization_id,
            "owner_id": owner or "*",
        }
        after = None
        if page_token:
            position = self._pages.decode(page_token, "sessions", query)
            after = _cursor_of(position)
        if not caller.is_service:
            # Even their own sessions: their summaries quote the project (docs/spec/authority.md).
            await self._projects.check(caller, project_id)
        sessions, cursor = await self._store.list_sessions(
            SessionQuery(
                project_id=project_id,
                organization_id=caller.organization_id,
                owner_id=owner,
                page_size=size,
                after=after,
            )
        )
        token = ""
        if cursor is not None:
            position = {"t": cursor.create_time.isoformat(), "id": cursor.session_id}
            token = self._pages.encode("sessions", query, position)
        return SessionPage(sessions=sessions, next_page_token=token)

    async def update_title(self, caller: Caller, session_id: str, title: str) -> Session:
        """``UpdateSession`` of the title, by the owner. Raises ``InvalidArgument``/
        ``TITLE_TOO_LONG``, ``NotFound`` (``SESSION_NOT_FOUND``, ``PROJECT_NOT_FOUND``),
        ``PermissionDenied``."""
        _check_title(title)
        await self.owned_session(caller, session_id)
        updated = await self._store.update_session_title(session_id, title, self._clock.now())
        if updated is None:
            raise _session_not_found(session_id)
        return updated

    async def delete_session(self, caller: Caller, session_id: str) -> None:
        """``DeleteSession`` by the owner: cancel a running turn, then remove the session
        with its messages, events, turns and idempotency keys in one transaction
        (docs/spec/api-and-streams.md). What the planner wrote to the project stays. Raises
        ``NotFound`` (``SESSION_NOT_FOUND``, ``PROJECT_NOT_FOUND``), ``PermissionDenied``/
        ``HUMAN_REQUIRED``."""
        session = await self.owned_session(caller, session_id)
        if session.running_turn_id:
            await self._store.request_cancel(session.running_turn_id)
        if not await self._store.delete_session(session_id):
            raise _session_not_found(session_id)

    async def list_messages(
        self,
        caller: Caller,
        *,
        session_id: str,
        after_sequence: int,
        page_size: int,
        page_token: str,
    ) -> MessagePage:
        """``ListMessages``: the transcript in sequence order after ``after_sequence``.

        A page holds at most ``page_size`` messages (0: 100, at most 1,000) and at most
        ``limits.page_max_bytes`` bytes, but always at least one message; a message larger
        than ``limits.client_message_max_bytes`` is listed truncated, so a page of one
        still fits a client's 4 MiB receive limit (decision 0222). A human's
        access to the project is re-checked (cached). Raises ``InvalidArgument``
        (``INVALID_AFTER_SEQUENCE``, ``INVALID_PAGE_SIZE``, ``INVALID_PAGE_TOKEN``),
        ``NotFound``, ``PermissionDenied``.
        """
        if after_sequence < 0:
            raise InvalidArgument(
                f"after_sequence must not be negative, got {after_sequence}",
                reason="INVALID_AFTER_SEQUENCE",
            )
        size = page_size_of(page_size, MESSAGES_PAGE_DEFAULT, MESSAGES_PAGE_MAX)
        await self.readable_session(caller, session_id)
        query = {"session_id": session_id, "after_sequence": str(after_sequence)}
        start = after_sequence
        if page_token:
            position = self._pages.decode(page_token, "messages", query)
            start = position.get("s", -1)
            if (
                not isinstance(start, int)
                or isinstance(start, bool)
                or not after_sequence <= start <= MAX_SEQUENCE
            ):
                raise bad_page_token()
        fetched = await self._store.list_messages(session_id, start, size + 1)
        page: list[Message] = []
        used = 0
        for stored in fetched[:size]:
            message = message_for_client(stored, self._limits.client_message_max_bytes)
            cost = self._message_size(message)
            if page and used + cost > self._limits.page_max_bytes:
                break
            page.append(message)
            used += cost
        more = len(page) < len(fetched)
        token = self._pages.encode("messages", query, {"s": page[-1].sequence}) if more else ""
        return MessagePage(messages=page, next_page_token=token)

    async def get_turn(self, caller: Caller, session_id: str, turn_id: str) -> Turn:
        """``GetTurn``: a turn of a session the caller may read. Raises ``NotFound``
        (``TURN_NOT_FOUND``, also for a turn of another session; ``SESSION_NOT_FOUND``;
        ``PROJECT_NOT_FOUND``), ``InvalidArgument``/``TURN_ID_REQUIRED``."""
        _require(turn_id, "turn_id")
        session = await self.readable_session(caller, session_id)
        turn = await self._store.get_turn(turn_id) if len(turn_id) <= ID_MAX_CHARS else None
        if turn is None or turn.session_id != session.session_id:
            raise NotFound(
                f"turn {echo(turn_id)!r} not found",
                reason="TURN_NOT_FOUND",
                metadata={"session_id": echo(session_id), "turn_id": echo(turn_id)},
            )
        return turn


def _cursor_of(position: Mapping[str, Any]) -> SessionCursor:
    created, session_id = position.get("t"), position.get("id")
    if (
        not isinstance(created, str)
        or not isinstance(session_id, str)
        or len(created) > _TIME_MAX_CHARS
        or len(session_id) > ID_MAX_CHARS
    ):
        raise bad_page_token()
    try:
        create_time = datetime.fromisoformat(created)
    except ValueError:
        raise bad_page_token() from None
    if create_time.tzinfo is None:
        raise bad_page_token()
    return SessionCursor(create_time=create_time, session_id=session_id)
