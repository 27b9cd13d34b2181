"""Credentials (docs/spec/authority.md): a token that expires ends an open
Chat stream ``TOKEN_EXPIRED``, and a turn whose token expires mid-turn ends
``FAILED``/``CREDENTIAL_EXPIRED`` at the end of its round; backends honour
``x-ballet-actor`` only with the planner's credential and refuse tokens without their
audience; ``serve`` in dev mode refuses a non-loopback address.

The devstack here allows no clock skew (``token_leeway_s=0``) and the planner neither
(``auth.leeway_s = 0``), so tokens are refused the moment their ``exp`` passes. The only
waits for the clock are for a known ``exp``: the test computes how long is left and
awaits exactly that (or scripts the model to answer just after it).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from ballet.knowledge.v1 import knowledge_pb2, knowledge_pb2_grpc
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import resources_pb2
from ballet.skills.v1 import skills_pb2, skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc

from ballet_common.tokens import KNOWLEDGE_AUDIENCE, PLANNER_AUDIENCE, TRACKER_AUDIENCE
from tests.hardening.support import (
    Chat,
    Metadata,
    Stack,
    failure,
    planner_command,
    refused,
    send_request,
    start_stack,
)

NO_LEEWAY = {"AUTH__LEEWAY_S": "0"}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path / "data", token_leeway_s=0.0)
    try:
        yield started
    finally:
        await started.stop()


def expires_at(token: str) -> float:
    return float(jwt.decode(token, options={"verify_signature": False})["exp"])


async def until_expired(token: str) -> None:
    """Await the moment ``token``'s ``exp`` has passed (its remaining life, computed)."""
    await asyncio.sleep(max(0.0, expires_at(token) - time.time()) + 0.05)


# --------------------------------------------------------------------------- streams


async def test_a_token_that_expires_mid_stream_ends_it_token_expired(stack: Stack) -> None:
    planner = await stack.planner(**NO_LEEWAY)
    token = stack.devstack.token("alice", ttl_s=2)
    chat = Chat(planner.stub, (("authorization", f"Bearer {token}"),))
    await chat.open("open-1")
    ended = await chat.turn("hello", "before-exp")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await until_expired(token)
    await chat.send(send_request("hello again", "after-exp"))
    error = await chat.ended()
    assert error is not None
    code, reason, _ = failure(error)
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_EXPIRED")
    # The client reopens with a fresh token and after_sequence; nothing was stored for
    # the message sent after expiry, and the replay picks up where it left off.
    fresh = Chat(planner.stub, stack.auth())
    await fresh.open(session_id=chat.session_id, after_sequence=ended.sequence)
    again = await fresh.turn("hello again", "after-exp")
    assert again.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    assert again.sequence == ended.sequence + 4  # accepted, started, answer, ended
    await fresh.close()


async def test_a_token_expiring_during_a_turn_fails_it_credential_expired(
    stack: Stack,
) -> None:
    planner = await stack.planner(**NO_LEEWAY)
    token = stack.devstack.token("alice", ttl_s=2)
    # The model holds its answer until just after exp, then calls two tools: the backends
    # refuse the expired token, and the turn ends at the end of that round.
    hold_ms = (expires_at(token) - time.time() + 0.3) * 1000
    stack.provider.set_scenario(
        {
            "rules": [
                {
                    "match": {"last_role": "human"},
                    "reply": {
                        "delay_ms": hold_ms,
                        "tool_calls": [
                            {"name": "list_items", "arguments": {}},
                            {"name": "list_skills", "arguments": {}},
                        ],
                    },
                },
                {"reply": {"text": "never asked"}},
            ]
        }
    )
    stack.gateway.reset()
    chat = Chat(planner.stub, (("authorization", f"Bearer {token}"),))
    await chat.open()
    await chat.send(send_request("plan something", "late"))
    results: list[resources_pb2.Message] = []
    while True:
        response = await chat.read()
        kind = response.WhichOneof("event")
        if kind == "tool_call_finished":
            results.append(response.tool_call_finished.message)
        elif kind == "turn_ended":
            break
    assert response.turn_ended.reason == resources_pb2.TURN_END_REASON_FAILED
    assert response.turn_ended.error_info.reason == "CREDENTIAL_EXPIRED"
    assert response.turn_ended.rounds == 1
    # Both calls of the round ran and got error results; no model call followed.
    assert len(results) == 2
    for message in results:
        assert message.tool_error
        assert json.loads(message.tool_result)["error"]["reason"] == "CREDENTIAL_EXPIRED"
    assert len(stack.gateway.requests) == 1
    refusals = [c for c in stack.devstack.calls if c.method in ("ListItems", "ListSkills")]
    assert {c.reason for c in refusals[-2:]} == {"TOKEN_EXPIRED"}
    chat.cancel()


# --------------------------------------------------------------------------- backends


async def test_a_forged_actor_without_the_planner_credential_is_not_the_planner(
    stack: Stack,
) -> None:
    devstack = stack.devstack
    token = devstack.token("alice")

    def other_service(audience: str) -> Metadata:
        # Valid for that backend, from the service-token issuer, but not the planner.
        forged = devstack.planner_credential(audience, subject="service:someone-else")
        return (("x-ballet-service-authorization", f"Bearer {forged}"),)

    attempts: dict[str, tuple[Metadata, Metadata]] = {
        "none": ((), ()),
        "other service": (other_service(TRACKER_AUDIENCE), other_service(KNOWLEDGE_AUDIENCE)),
    }
    async with grpc.aio.insecure_channel(devstack.address) as channel:
        tracker = tracker_pb2_grpc.TrackerServiceStub(channel)
        knowledge = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        for label, (to_tracker, to_knowledge) in attempts.items():
            base = (
                ("authorization", f"Bearer {token}"),
                ("x-ballet-actor", "planner:forged-session"),
            )
            await tracker.ListItems(
                tracker_pb2.ListItemsRequest(project_id="demo"), metadata=(*base, *to_tracker)
            )
            written = await knowledge.CreateKnowledgeEntry(
                knowledge_pb2.CreateKnowledgeEntryRequest(
                    request_id=f"forged-{label}",
                    kind=knowledge_pb2.KNOWLEDGE_KIND_NOTE,
                    title="forged",
                    body="b",
                    project_id="demo",
                ),
                metadata=(*base, *to_knowledge),
            )
            for method in ("ListItems", "CreateKnowledgeEntry"):
                record = devstack.calls_for(method)[-1]
                assert (record.human, record.actor) == ("alice", ""), label
                assert record.actor_header == "planner:forged-session"
            # The write is recorded as made by alice herself, not by a planner.
            assert (written.entry.author_id, written.entry.recorded_by) == ("alice", "alice")
    # The planner's own calls, with its credential, are recorded as the planner.
    planner = await stack.planner()
    chat = Chat(planner.stub, stack.auth())
    await chat.open()
    ended = await chat.turn("list items", "items")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await chat.close()
    record = devstack.calls_for("ListItems")[-1]
    assert (record.human, record.actor) == ("alice", f"planner:{chat.session_id}")


async def test_a_token_without_a_backends_audience_is_refused_by_it(stack: Stack) -> None:
    devstack = stack.devstack
    planner_only = devstack.token("alice", audiences=(PLANNER_AUDIENCE,))
    tracker_only = devstack.token("alice", audiences=(TRACKER_AUDIENCE,))
    async with grpc.aio.insecure_channel(devstack.address) as channel:
        calls: dict[str, Any] = {
            "tracker": lambda md: tracker_pb2_grpc.TrackerServiceStub(channel).GetProject(
                tracker_pb2.GetProjectRequest(project_id="demo"), metadata=md
            ),
            "skills": lambda md: skills_pb2_grpc.SkillsServiceStub(channel).ListSkills(
                skills_pb2.ListSkillsRequest(project_id="demo"), metadata=md
            ),
            "knowledge": lambda md: knowledge_pb2_grpc.KnowledgeServiceStub(
                channel
            ).SearchKnowledge(knowledge_pb2.SearchKnowledgeRequest(query="x"), metadata=md),
        }
        for name, call in calls.items():
            for token in (planner_only, tracker_only):
                if name == "tracker" and token == tracker_only:
                    await call((("authorization", f"Bearer {token}"),))
                    continue
                code, reason, _ = await refused(call((("authorization", f"Bearer {token}"),)))
                assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "WRONG_AUDIENCE"), name
    # Through the planner: the tracker refuses the project check of a token meant only
    # for the planner, so no session is created.
    planner = await stack.planner()
    code, reason, _ = await refused(
        planner.stub.CreateSession(
            pb.CreateSessionRequest(request_id="r", project_id="demo"),
            metadata=(("authorization", f"Bearer {planner_only}"),),
        )
    )
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "WRONG_AUDIENCE")


# --------------------------------------------------------------------------- dev mode


def test_serve_without_keys_refuses_a_non_loopback_address(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "BALLET_PLANNER__DATA_DIR": str(tmp_path / "data"),
        "BALLET_PLANNER__SERVER__ADDRESS": "0.0.0.0:0",
    }
    result = subprocess.run(
        [*planner_command(), "serve"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "server.address" in result.stderr and "dev mode" in result.stderr
    assert "auth.jwks_path" in result.stderr
    # It refused before binding anything or creating a database.
    assert not (tmp_path / "data" / "planner.db").exists()
