"""The ``ballet.planner.v1.PlannerService`` servicer (docs/spec/api-and-streams.md).

Thin: authenticate, convert the request, make one call into the core (the session rules
of ``service.core.sessions``; the turn side, ``service.core.chat.ChatService``), convert
the result. Errors leave through ``service.transport.errors`` (one ``ErrorInfo``, domain
``planner.ballet``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ballet.planner.v1 import (
    chat_pb2,
    planner_service_pb2,
    planner_service_pb2_grpc,
    resources_pb2,
)

from service.core.chat import ChatService
from service.core.errors import InvalidArgument
from service.core.model import TurnState
from service.core.sessions import SessionRules
from service.transport import chat, convert
from service.transport.auth import Authenticator
from service.transport.errors import Context, rpc_errors

#: The only field ``UpdateSession`` changes (AIP-134: an empty mask means it too).
UPDATABLE_FIELDS = frozenset({"title"})


class PlannerServicer(planner_service_pb2_grpc.PlannerServiceServicer):
    """PlannerService over ``SessionRules`` and, for the turn RPCs, ``ChatService``."""

    def __init__(
        self, rules: SessionRules, authenticator: Authenticator, turns: ChatService
    ) -> None:
        self._rules = rules
        self._auth = authenticator
        self._turns = turns

    # -- sessions ------------------------------------------------------------------

    async def CreateSession(
        self, request: planner_service_pb2.CreateSessionRequest, context: Context
    ) -> planner_service_pb2.CreateSessionResponse:
        """Create a session in a project the caller may read (idempotent, AIP-155)."""
        async with rpc_errors(context):
            session = await self._rules.create_session(
                self._auth.caller(context),
                request_id=request.request_id,
                project_id=request.project_id,
                title=request.title,
            )
            return planner_service_pb2.CreateSessionResponse(
                session=convert.session_to_proto(session)
            )

    async def GetSession(
        self, request: planner_service_pb2.GetSessionRequest, context: Context
    ) -> planner_service_pb2.GetSessionResponse:
        """Get a session with its summary and ``summary_up_to``."""
        async with rpc_errors(context):
            session = await self._rules.get_session(self._auth.caller(context), request.session_id)
            return planner_service_pb2.GetSessionResponse(session=convert.session_to_proto(session))

    async def ListSessions(
        self, request: planner_service_pb2.ListSessionsRequest, context: Context
    ) -> planner_service_pb2.ListSessionsResponse:
        """List a project's sessions, newest first (AIP-158)."""
        async with rpc_errors(context):
            page = await self._rules.list_sessions(
                self._auth.caller(context),
                project_id=request.project_id,
                page_size=request.page_size,
                page_token=request.page_token,
            )
            return planner_service_pb2.ListSessionsResponse(
                sessions=[convert.session_to_proto(session) for session in page.sessions],
                next_page_token=page.next_page_token,
            )

    async def UpdateSession(
        self, request: planner_service_pb2.UpdateSessionRequest, context: Context
    ) -> planner_service_pb2.UpdateSessionResponse:
        """Update a session's title; ``update_mask`` may name only ``title`` (AIP-134)."""
        async with rpc_errors(context):
            caller = self._auth.caller(context)
            paths = set(request.update_mask.paths)
            if not paths <= UPDATABLE_FIELDS:
                raise InvalidArgument(
                    f"update_mask may only name {', '.join(sorted(UPDATABLE_FIELDS))}, got "
                    f"{', '.join(sorted(paths - UPDATABLE_FIELDS))}",
                    reason="INVALID_UPDATE_MASK",
                )
            session = await self._rules.update_title(
                caller, request.session.session_id, request.session.title
            )
            return planner_service_pb2.UpdateSessionResponse(
                session=convert.session_to_proto(session)
            )

    async def DeleteSession(
        self, request: planner_service_pb2.DeleteSessionRequest, context: Context
    ) -> planner_service_pb2.DeleteSessionResponse:
        """Delete a session and everything stored with it (its running turn cancelled)."""
        async with rpc_errors(context):
            await self._rules.delete_session(self._auth.caller(context), request.session_id)
            self._turns.session_deleted(request.session_id)
            return planner_service_pb2.DeleteSessionResponse()

    async def ListMessages(
        self, request: planner_service_pb2.ListMessagesRequest, context: Context
    ) -> planner_service_pb2.ListMessagesResponse:
        """List a session's transcript in sequence order, at most 1 MiB a page."""
        async with rpc_errors(context):
            page = await self._rules.list_messages(
                self._auth.caller(context),
                session_id=request.session_id,
                after_sequence=request.after_sequence,
                page_size=request.page_size,
                page_token=request.page_token,
            )
            return planner_service_pb2.ListMessagesResponse(
                messages=[convert.message_to_proto(message) for message in page.messages],
                next_page_token=page.next_page_token,
            )

    async def GetTurn(
        self, request: planner_service_pb2.GetTurnRequest, context: Context
    ) -> planner_service_pb2.GetTurnResponse:
        """Get a turn's state, end reason, rounds, usage and versions."""
        async with rpc_errors(context):
            turn = await self._rules.get_turn(
                self._auth.caller(context), request.session_id, request.turn_id
            )
            return planner_service_pb2.GetTurnResponse(turn=convert.turn_to_proto(turn))

    # -- turns ---------------------------------------------------------------------

    async def SendMessage(
        self, request: planner_service_pb2.SendMessageRequest, context: Context
    ) -> planner_service_pb2.SendMessageResponse:
        """Run one whole turn and return its outcome and messages. When the caller's
        deadline passes the call ends ``DEADLINE_EXCEEDED`` and the turn goes on;
        ``GetTurn`` reads its outcome."""
        async with rpc_errors(context):
            turn, messages = await self._turns.send_message(
                self._auth.caller(context),
                request.session_id,
                request.text,
                request.request_id,
                convert.on_busy_from_proto(request.on_busy),
            )
            queued = turn.state is TurnState.QUEUED
            return planner_service_pb2.SendMessageResponse(
                turn=convert.turn_to_proto(turn),
                messages=[convert.message_to_proto(m) for m in messages],
                disposition=resources_pb2.MESSAGE_DISPOSITION_QUEUED
                if queued
                else resources_pb2.MESSAGE_DISPOSITION_STARTED,
            )

    async def CancelTurn(
        self, request: planner_service_pb2.CancelTurnRequest, context: Context
    ) -> planner_service_pb2.CancelTurnResponse:
        """Cancel a turn on whichever replica runs it; an ended turn is returned
        unchanged, an unknown one is ``NOT_FOUND``."""
        async with rpc_errors(context):
            turn = await self._turns.cancel_turn(
                self._auth.caller(context), request.session_id, request.turn_id, request.request_id
            )
            return planner_service_pb2.CancelTurnResponse(turn=convert.turn_to_proto(turn))

    async def Chat(
        self, request_iterator: AsyncIterator[chat_pb2.ChatRequest], context: Context
    ) -> AsyncIterator[chat_pb2.ChatResponse]:
        """The bidirectional Chat stream (``service.transport.chat``; grpc.aio serves
        a stream from an async generator function)."""
        async for response in chat.chat(self._turns, self._auth, request_iterator, context):
            yield response
