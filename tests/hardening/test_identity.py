"""Identity and access through the real planner and devstack on loopback.

- A human token with any ``scope`` claim reads nothing of another human's
  (refused ``SCOPE_NOT_ALLOWED`` by the planner and the backends), and a token that names
  the service issuer without its key is no service principal.
- A human whose project role is removed gets ``NOT_FOUND`` from every session
  RPC within the cache period, Chat ``open``/``send_message``/``cancel_turn`` included.
- The credential the gateway receives is refused by the tracker, skills and
  knowledge backends.
- A forged, tampered or out-of-range page token is
  ``INVALID_ARGUMENT``/``INVALID_PAGE_TOKEN`` on every paginated RPC.
- Identifiers echoed in errors are bounded: a 1 MiB ``session_id`` gives a small
  ``NOT_FOUND``.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.knowledge.v1 import knowledge_pb2, knowledge_pb2_grpc
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc, resources_pb2
from ballet.skills.v1 import skills_pb2, skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc
from google.protobuf import field_mask_pb2

from ballet_common.tokens import (
    DEV_SERVICE_ISSUER,
    PLANNER_AUDIENCE,
    mint_dev_service_token,
    mint_dev_token,
)
from service.core.pages import PageTokens
from service.core.sessions import READ_SCOPE
from service.server.root import start_planner
from tests.hardening.support import (
    Chat,
    Metadata,
    Planner,
    Stack,
    cancel_request,
    create_session,
    error_info,
    failure,
    open_request,
    refused,
    send_request,
    start_stack,
)
from tests.service.planner_support import auth, planner_settings


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path / "data")
    try:
        yield started
    finally:
        await started.stop()


async def a_session_with_a_turn(planner: Planner, metadata: Metadata) -> tuple[str, str]:
    """A session of the token's human with one completed turn: (session id, turn id)."""
    chat = Chat(planner.stub, metadata)
    await chat.open()
    ended = await chat.turn("hello", "first")
    await chat.close()
    return chat.session_id, ended.turn_id


def reads(stub: Any, session_id: str, turn_id: str) -> dict[str, Callable[[Metadata], Any]]:
    """Every RPC that returns session data, for ``session_id``."""
    return {
        "GetSession": lambda md: stub.GetSession(
            pb.GetSessionRequest(session_id=session_id), metadata=md
        ),
        "ListSessions": lambda md: stub.ListSessions(
            pb.ListSessionsRequest(project_id="demo"), metadata=md
        ),
        "ListMessages": lambda md: stub.ListMessages(
            pb.ListMessagesRequest(session_id=session_id), metadata=md
        ),
        "GetTurn": lambda md: stub.GetTurn(
            pb.GetTurnRequest(session_id=session_id, turn_id=turn_id), metadata=md
        ),
    }


# ---------------------------------------------------------------------------------------


async def test_a_human_token_with_a_scope_reads_nothing_of_another_humans(
    stack: Stack,
) -> None:
    planner = await stack.planner()
    session_id, turn_id = await a_session_with_a_turn(planner, stack.auth("alice"))
    secret = stack.devstack.dev_secret
    scoped = {
        # The attack: bob's own token, with a scope added by whoever minted it.
        "scope": mint_dev_token(secret, "bob", claims={"scope": READ_SCOPE}),
        "empty scope": mint_dev_token(secret, "bob", claims={"scope": ""}),
        "scope list": mint_dev_token(secret, "bob", claims={"scope": [READ_SCOPE]}),
    }
    for label, token in scoped.items():
        for name, call in reads(planner.stub, session_id, turn_id).items():
            code, reason, _ = await refused(call(auth(token)))
            assert (code, reason) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "SCOPE_NOT_ALLOWED",
            ), (label, name)
        chat = Chat(planner.stub, auth(token))
        await chat.send(open_request(session_id=session_id))
        error = await chat.ended()
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
    # Naming the service issuer does not make a service: the signature is the human key's.
    posing = mint_dev_token(
        secret, "bob", issuer=DEV_SERVICE_ISSUER, claims={"scope": READ_SCOPE}
    )
    for call in reads(planner.stub, session_id, turn_id).values():
        code, reason, _ = await refused(call(auth(posing)))
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
    # The backends refuse a scoped human token too (they would otherwise act for bob).
    async with grpc.aio.insecure_channel(stack.devstack.address) as channel:
        tracker = tracker_pb2_grpc.TrackerServiceStub(channel)
        code, reason, _ = await refused(
            tracker.ListItems(
                tracker_pb2.ListItemsRequest(project_id="demo"), metadata=auth(scoped["scope"])
            )
        )
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "SCOPE_NOT_ALLOWED")
    # A real service principal (the service-token issuer's key) does read it.
    reader = mint_dev_service_token(
        secret,
        "service:reports",
        audiences=(PLANNER_AUDIENCE,),
        scopes=(READ_SCOPE,),
        organization_id="acme",
    )
    for call in reads(planner.stub, session_id, turn_id).values():
        await call(auth(reader))


# ---------------------------------------------------------------------------------------


class ShiftedClock:
    """The planner's clock with monotonic time movable forward (the project check cache
    is the only user of ``monotonic``): the cache lapses without a wait."""

    def __init__(self) -> None:
        self.shift_s = 0.0

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic() + self.shift_s


async def test_a_human_whose_role_is_removed_gets_not_found_everywhere(stack: Stack) -> None:
    clock = ShiftedClock()
    app = await start_planner(
        planner_settings(stack.data_dir, stack.devstack.address, stack.database_url),
        clock=clock,
    )
    channel = grpc.aio.insecure_channel(app.address)
    planner = Planner(app, channel, planner_service_pb2_grpc.PlannerServiceStub(channel))
    stack.planners.append(planner)
    bob = stack.auth("bob")
    session_id, turn_id = await a_session_with_a_turn(planner, bob)
    doomed = await create_session(planner, bob, "to-delete")
    stream = Chat(planner.stub, bob)
    await stream.open(session_id=session_id)

    await stack.devstack.set_role("bob", "demo", None)
    # Within the cache period the cached answer may still serve (at most 60 s,
    # docs/spec/authority.md)...
    await planner.stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=bob)
    clock.shift_s += 61
    # ...and once it has lapsed every session RPC is NOT_FOUND.
    stub = planner.stub
    calls: dict[str, Awaitable[Any]] = {
        **{name: call(bob) for name, call in reads(stub, session_id, turn_id).items()},
        "UpdateSession": stub.UpdateSession(
            pb.UpdateSessionRequest(
                session=resources_pb2.Session(session_id=session_id, title="mine"),
                update_mask=field_mask_pb2.FieldMask(paths=["title"]),
            ),
            metadata=bob,
        ),
        "DeleteSession": stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=doomed), metadata=bob
        ),
        "CancelTurn": stub.CancelTurn(
            pb.CancelTurnRequest(session_id=session_id, turn_id=turn_id), metadata=bob
        ),
        "SendMessage": stub.SendMessage(
            pb.SendMessageRequest(session_id=session_id, text="hi", request_id="late"),
            metadata=bob,
        ),
    }
    for name, call in calls.items():
        code, reason, _ = await refused(call)
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "PROJECT_NOT_FOUND"), name
    # Chat: the stream opened before the loss refuses send_message and cancel_turn...
    for request in (send_request("hi", "late-chat"), cancel_request(turn_id, "cancel")):
        await stream.send(request)
        reply = await stream.until("error")
        assert reply.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert error_info(reply.error).reason == "PROJECT_NOT_FOUND"
        assert reply.request_id == request.request_id
    await stream.close()
    # ...and a new stream cannot open the session.
    again = Chat(planner.stub, bob)
    await again.send(open_request("reopen", session_id=session_id))
    reply = await again.until("error")
    assert error_info(reply.error).reason == "PROJECT_NOT_FOUND"
    await again.close()
    # Nothing was stored or deleted on the way; with the role back it all works at once.
    await stack.devstack.set_role("bob", "demo", "viewer")
    got = await stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=bob)
    assert got.session.title != "mine"
    await stub.GetSession(pb.GetSessionRequest(session_id=doomed), metadata=bob)
    messages = await stub.ListMessages(
        pb.ListMessagesRequest(session_id=session_id), metadata=bob
    )
    humans = [m.text for m in messages.messages if m.kind == resources_pb2.MESSAGE_KIND_HUMAN]
    assert humans == ["hello"]


# ---------------------------------------------------------------------------------------


async def test_the_credential_the_gateway_receives_is_refused_by_every_backend(
    stack: Stack,
) -> None:
    planner = await stack.planner()
    stack.gateway.reset()
    await a_session_with_a_turn(planner, stack.auth("alice"))
    leaked = stack.gateway.credentials[-1]
    assert leaked.startswith("Bearer ")
    # Replayed as a gateway that logs it would: alice's own token, a planner actor.
    metadata = (
        *stack.auth("alice"),
        ("x-ballet-actor", "planner:replayed"),
        ("x-ballet-service-authorization", leaked),
    )
    async with grpc.aio.insecure_channel(stack.devstack.address) as channel:
        calls = {
            "tracker": tracker_pb2_grpc.TrackerServiceStub(channel).ProposeChangeset(
                tracker_pb2.ProposeChangesetRequest(
                    request_id="replay", project_id="demo", title="replayed"
                ),
                metadata=metadata,
            ),
            "skills": skills_pb2_grpc.SkillsServiceStub(channel).ListSkills(
                skills_pb2.ListSkillsRequest(project_id="demo"), metadata=metadata
            ),
            "knowledge": knowledge_pb2_grpc.KnowledgeServiceStub(channel).CreateKnowledgeEntry(
                knowledge_pb2.CreateKnowledgeEntryRequest(
                    request_id="replay",
                    kind=knowledge_pb2.KNOWLEDGE_KIND_NOTE,
                    title="replayed",
                    body="b",
                ),
                metadata=metadata,
            ),
        }
        for name, call in calls.items():
            code, reason, status = await refused(call)
            assert (code, reason) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "SERVICE_CREDENTIAL_INVALID",
            ), name
            assert error_info(status).metadata["credential_reason"] == "WRONG_AUDIENCE"
    assert "replay" not in stack.devstack.writes
    # The planner's own calls went through with their own credentials.
    assert all(c.actor.startswith("planner:") for c in stack.devstack.calls if c.human)


# ---------------------------------------------------------------------------------------


def _v1_token(position: dict[str, Any]) -> str:
    """A token in the old unkeyed format, position chosen by the client."""
    body = json.dumps({"v": 1, "p": position, "f": "AAAAAAAAAAAAAAAAAAAAAA"})
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


async def test_forged_or_out_of_range_page_tokens_are_invalid_on_every_list(
    stack: Stack,
) -> None:
    planner = await stack.planner()
    alice = stack.auth("alice")
    session_id, _ = await a_session_with_a_turn(planner, alice)
    await a_session_with_a_turn(planner, alice)
    stub = planner.stub
    sessions = await stub.ListSessions(
        pb.ListSessionsRequest(project_id="demo", page_size=1), metadata=alice
    )
    messages = await stub.ListMessages(
        pb.ListMessagesRequest(session_id=session_id, page_size=1), metadata=alice
    )
    assert sessions.next_page_token and messages.next_page_token
    stranger = PageTokens(lambda: [b"a-key-this-planner-never-held-0000"])
    forged_messages = stranger.encode(
        "messages", {"session_id": session_id, "after_sequence": "0"}, {"s": 2**70}
    )
    forged_sessions = stranger.encode(
        "sessions",
        {"project_id": "demo", "organization_id": "acme", "owner_id": "alice"},
        {"t": "9999-12-31T23:59:59+00:00", "id": "x"},
    )

    def flipped(token: str) -> str:
        return token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]

    lists: dict[str, tuple[Callable[[str], Any], list[str]]] = {
        "ListSessions": (
            lambda token: stub.ListSessions(
                pb.ListSessionsRequest(project_id="demo", page_token=token), metadata=alice
            ),
            [
                forged_sessions,
                _v1_token({"t": "2026-01-01T00:00:00+00:00", "id": "x"}),
                flipped(sessions.next_page_token),
                messages.next_page_token,
            ],
        ),
        "ListMessages": (
            lambda token: stub.ListMessages(
                pb.ListMessagesRequest(session_id=session_id, page_token=token),
                metadata=alice,
            ),
            [
                forged_messages,
                _v1_token({"s": 2**70}),
                flipped(messages.next_page_token),
                sessions.next_page_token,
            ],
        ),
    }
    for name, (call, tokens) in lists.items():
        for token in [*tokens, "A" * 4096, "not base64 at all!", "\u00e9\u00e9"]:
            code, reason, status = await refused(call(token))
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_TOKEN"), (
                name,
                token[:40],
            )
            assert len(status.details) == 1
        # The real tokens still work.
    await stub.ListSessions(
        pb.ListSessionsRequest(project_id="demo", page_token=sessions.next_page_token),
        metadata=alice,
    )
    await stub.ListMessages(
        pb.ListMessagesRequest(session_id=session_id, page_token=messages.next_page_token),
        metadata=alice,
    )


# --------------------------------------------------------------------------- bounded ids


async def test_a_huge_identifier_gives_a_small_not_found(stack: Stack) -> None:
    planner = await stack.planner()
    alice = stack.auth("alice")
    session_id = await create_session(planner, alice, "real")
    huge = "s" * (1024 * 1024)
    stub = planner.stub
    for call in (
        stub.GetSession(pb.GetSessionRequest(session_id=huge), metadata=alice),
        stub.ListMessages(pb.ListMessagesRequest(session_id=huge), metadata=alice),
        stub.GetTurn(pb.GetTurnRequest(session_id=session_id, turn_id=huge), metadata=alice),
        stub.CancelTurn(pb.CancelTurnRequest(session_id=huge), metadata=alice),
        stub.ListSessions(pb.ListSessionsRequest(project_id=huge), metadata=alice),
    ):
        try:
            await call
        except grpc.aio.AioRpcError as error:
            code, reason, status = failure(error)
            assert code == grpc.StatusCode.NOT_FOUND, reason
            assert len(status.SerializeToString()) < 1024
            assert len(error.details() or "") < 256
        else:
            raise AssertionError("a 1 MiB id was found")
    # Found by the property test: a refusal quoting 100,000 emoji used to overflow the
    # trailers (the client saw RESOURCE_EXHAUSTED); it is cut to fit like any other.
    code, reason, status = await refused(
        stub.UpdateSession(
            pb.UpdateSessionRequest(
                session=resources_pb2.Session(session_id=session_id, title="t"),
                update_mask=field_mask_pb2.FieldMask(paths=["\U0001f3ad" * 100_000]),
            ),
            metadata=alice,
        )
    )
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_UPDATE_MASK")
    assert len(status.SerializeToString()) < 1024
