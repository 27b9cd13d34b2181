"""A property-based test of every unary PlannerService RPC: random
and boundary input never produces ``INTERNAL`` or ``UNKNOWN``, and every refusal carries
exactly one ``ErrorInfo`` of domain ``planner.ballet`` (AIP-193).

One real planner (a ``ballet-planner serve`` process) on PostgreSQL with the devstack
and a scripted model that answers at once, shared by every example. Each RPC is one
family of ``EXAMPLES`` examples; each example is one call with:

- ids of every length (empty, UUID-like, 63/64/65, 256/257, 64 KiB, 1 MiB; NUL, accents,
  emoji) or one of the rig's real sessions and turns (alice's, bob's; for DeleteSession
  mostly one created for the example);
- page sizes and ``after_sequence`` over their whole int32/int64 ranges and around the
  caps; page tokens that are real, mutated, forged (base64 JSON with huge positions) or
  random;
- titles, texts and request ids around their limits (256 characters, 32 KiB, 64);
- the caller: alice mostly, bob, a service principal, a human token with ``scope``, no,
  expired or garbage token;
- and in about a fifth of the examples, the serialized request with invalid UTF-8 added
  in one of its string fields (or random bytes instead of a request), sent raw.

Nothing is logged at ERROR (by the planner process or the devstack); afterwards health
is SERVING and no turn is left running.
``--hypothesis-show-statistics`` lists the outcomes seen per family.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc, resources_pb2
from google.protobuf import descriptor, field_mask_pb2, message
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from ballet_common.tokens import PLANNER_AUDIENCE, mint_dev_service_token, mint_dev_token
from service.adapters.store import make_engine
from service.core.sessions import READ_SCOPE
from service.transport.decoding import SERVICE
from tests.hardening.support import PlannerProcess, Stack, serve_process, start_stack
from tests.hardening.test_undecodable import encoded, string_paths
from tests.pg import PgServer

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

EXAMPLES = 2000
#: The planner's receive limit (server.max_receive_message_bytes): gRPC itself refuses a
#: larger request RESOURCE_EXHAUSTED, before any handler and without an ErrorInfo.
RECEIVE_LIMIT = 4 * 1024 * 1024
BUG_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
METHODS = {method.name: method for method in SERVICE.methods if not method.client_streaming}

# --------------------------------------------------------------------------- strategies

#: Placeholders for the rig's real ids, resolved when the example runs (hypothesis draws
#: examples before the fixture exists).
SESSION_REFS = ["@alice", "@alice-2", "@bob"]
TURN_REFS = ["@alice-turn", "@bob-turn"]
TOKEN_REFS = ["@sessions-token", "@messages-token", "@sessions-token~", "@messages-token~"]

def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each drawn in proportion to its weight."""
    slots = [index for index, (weight, _) in enumerate(choices) for _ in range(weight)]
    return st.sampled_from(slots).flatmap(lambda index: choices[index][1])


boundary_text = st.one_of(
    st.sampled_from([0, 1, 36, 63, 64, 65, 255, 256, 257, 1024, 32 * 1024, 32 * 1024 + 1]).flatmap(
        lambda n: st.sampled_from(["x", "\u00e9", "\x00", "\U0001f3ad"]).map(lambda c: c * n)
    ),
    st.sampled_from([64 * 1024, 1024 * 1024]).map(lambda n: "s" * n),
)
any_text = st.one_of(st.text(max_size=80), boundary_text, st.sampled_from(["", " ", "\x00"]))
ids = weighted(
    (6, st.sampled_from(SESSION_REFS)), (3, any_text), (1, st.uuids().map(str))
)
turn_ids = weighted((6, st.sampled_from(TURN_REFS)), (3, any_text), (1, st.uuids().map(str)))
project_ids = st.one_of(st.sampled_from(["demo", "demo", "globex-ops", "DEMO"]), any_text)
request_ids = st.one_of(
    st.just(""),
    st.uuids().map(str),
    st.text(min_size=1, max_size=70),
    st.sampled_from(["same", "same", "x" * 64, "x" * 65]),
)
page_sizes = st.one_of(
    st.integers(-5, 1100),
    st.sampled_from([-(2**31), 2**31 - 1, 0, 50, 100, 101, 1000, 1001]),
    st.integers(-(2**31), 2**31 - 1),
)
sequences = weighted(
    (6, st.integers(0, 40)),
    (1, st.integers(-3, -1)),
    (1, st.sampled_from([-(2**63), 2**63 - 1, 2**31, 2**53 + 1])),
    (2, st.integers(-(2**63), 2**63 - 1)),
)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


forged_positions = st.one_of(
    st.fixed_dictionaries({"s": st.one_of(st.integers(), st.floats(), st.text(max_size=5))}),
    st.fixed_dictionaries({"t": any_text, "id": any_text}),
    st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=5), max_size=3),
)
page_tokens = weighted(
    (5, st.just("")),
    (2, st.sampled_from(TOKEN_REFS)),
    (1, any_text),
    (1, st.binary(max_size=120).map(_b64)),
    (
        1,
        st.tuples(st.sampled_from([1, 2, "2", None]), forged_positions, st.text(max_size=30)).map(
            lambda t: _b64(json.dumps({"v": t[0], "p": t[1], "m": t[2], "f": t[2]}).encode())
        ),
    ),
)
callers = st.sampled_from(
    ["alice"] * 14 + ["bob", "bob", "reader", "reader", "scoped", "none", "expired", "garbage"]
)
invalid_utf8 = st.one_of(
    # A lone continuation byte, a truncated sequence, a surrogate, beyond U+10FFFF...
    st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"ok\x80"]),
    # ...or random bytes around a byte that never occurs in UTF-8.
    st.tuples(
        st.binary(max_size=12), st.sampled_from([b"\xff", b"\xfe"]), st.binary(max_size=4)
    ).map(b"".join),
)


def requests(name: str) -> st.SearchStrategy[message.Message]:
    """Requests of the RPC ``name`` with random and boundary field values."""
    if name == "CreateSession":
        return st.builds(
            pb.CreateSessionRequest, request_id=request_ids, project_id=project_ids, title=any_text
        )
    if name == "GetSession":
        return st.builds(pb.GetSessionRequest, session_id=ids)
    if name == "ListSessions":
        return st.builds(
            pb.ListSessionsRequest,
            project_id=project_ids,
            page_size=page_sizes,
            page_token=page_tokens,
        )
    if name == "UpdateSession":
        masks = st.lists(
            st.one_of(st.sampled_from(["title", "title", "summary", "session_id", ""]), any_text),
            max_size=3,
        )
        return st.builds(
            lambda sid, title, summary, paths: pb.UpdateSessionRequest(
                session=resources_pb2.Session(session_id=sid, title=title, summary=summary),
                update_mask=field_mask_pb2.FieldMask(paths=paths),
            ),
            ids,
            any_text,
            st.one_of(st.just(""), any_text),
            masks,
        )
    if name == "DeleteSession":
        # Mostly a session made for the example, so that deletes succeed and the rig's
        # sessions stay for the other families.
        return st.builds(
            pb.DeleteSessionRequest, session_id=weighted((5, st.just("@fresh")), (5, ids))
        )
    if name == "ListMessages":
        return st.builds(
            pb.ListMessagesRequest,
            session_id=ids,
            after_sequence=sequences,
            page_size=page_sizes,
            page_token=page_tokens,
        )
    if name == "GetTurn":
        return st.builds(pb.GetTurnRequest, session_id=ids, turn_id=turn_ids)
    if name == "CancelTurn":
        return st.builds(
            pb.CancelTurnRequest,
            session_id=ids,
            turn_id=st.one_of(st.just(""), turn_ids),
            request_id=request_ids,
        )
    if name == "SendMessage":
        texts = st.one_of(
            any_text, st.sampled_from(["hello", "list items please", "a" * (32 * 1024)])
        )
        return st.builds(
            pb.SendMessageRequest,
            session_id=st.one_of(st.sampled_from(SESSION_REFS), ids),
            text=texts,
            request_id=st.one_of(st.uuids().map(str), request_ids),
        )
    raise AssertionError(f"no strategy for {name}")  # pragma: no cover - every RPC has one


@dataclass(frozen=True)
class Example:
    """One call: the request, the caller, and how its bytes are spoiled (if at all)."""

    request: message.Message
    caller: str
    spoil: tuple[int, bytes] | None = None  # (string path index, invalid bytes)
    raw: bytes | None = None  # random bytes sent instead of the request


def examples(name: str) -> st.SearchStrategy[Example]:
    plain = st.builds(Example, requests(name), callers)
    spoiled = st.builds(
        lambda request, caller, index, junk: Example(request, caller, (index, junk)),
        requests(name),
        callers,
        st.integers(0, 1000),
        invalid_utf8,
    )
    noise = st.builds(
        lambda caller, raw: Example(GetMessageClass(METHODS[name].input_type)(), caller, raw=raw),
        callers,
        st.binary(max_size=64),
    )
    return weighted((7, plain), (2, spoiled), (1, noise))


# --------------------------------------------------------------------------- the rig


class ErrorRecords(logging.Handler):
    """Every record at ERROR or above from a logger of this process (the devstack's)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Rig:
    """The devstack (in this process), a ``ballet-planner serve`` process on PostgreSQL,
    and a channel to it; ``refs`` resolve the placeholders, ``callers`` are metadata."""

    stack: Stack
    planner: PlannerProcess
    channel: grpc.aio.Channel
    refs: dict[str, str] = field(default_factory=dict)
    callers: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    errors: ErrorRecords = field(default_factory=ErrorRecords)
    _log_offset: int = 0

    @property
    def stub(self) -> planner_service_pb2_grpc.PlannerServiceStub:
        return planner_service_pb2_grpc.PlannerServiceStub(self.channel)

    def new_errors(self) -> list[str]:
        """Lines logged at ERROR (or a traceback) since the last call, by the planner
        process or the devstack."""
        with self.planner.log_path.open("rb") as log:
            log.seek(self._log_offset)
            text = log.read()
        # Only whole lines: a line being written is read next time.
        whole = text[: text.rfind(b"\n") + 1]
        self._log_offset += len(whole)
        found = [f"devstack: {r.getMessage()}" for r in self.errors.records]
        self.errors.records.clear()
        for line in whole.decode(errors="replace").splitlines():
            if line.startswith("{"):
                if json.loads(line).get("level") in ("ERROR", "CRITICAL"):
                    found.append(line)
            elif line.startswith("Traceback") or re.match(r"E\d{4} ", line):
                found.append(line)
        return found


@pytest.fixture(scope="module")
async def rig(
    tmp_path_factory: pytest.TempPathFactory, pg_cluster: PgServer
) -> AsyncIterator[Rig]:
    database = f"props_{uuid.uuid4().hex[:12]}"
    pg_cluster.create_database(database)
    url = pg_cluster.url(database)
    work = tmp_path_factory.mktemp("props")
    stack = await start_stack(work / "data", database_url=url)
    errors = ErrorRecords()
    logging.getLogger().addHandler(errors)
    served: PlannerProcess | None = None
    try:
        # Its own process: the planner works on one core while this one generates
        # examples and serves the devstack on the other.
        served = await serve_process(
            stack, work / "planner.log", SERVER__REPLICA_ID="props-replica"
        )
        rig = Rig(stack, served, grpc.aio.insecure_channel(served.address), errors=errors)
        secret = stack.devstack.dev_secret
        rig.callers = {
            "alice": stack.auth("alice"),
            "bob": stack.auth("bob"),
            "reader": _bearer(
                mint_dev_service_token(
                    secret,
                    "service:reports",
                    audiences=(PLANNER_AUDIENCE,),
                    scopes=(READ_SCOPE,),
                    organization_id="acme",
                )
            ),
            "scoped": _bearer(mint_dev_token(secret, "bob", claims={"scope": READ_SCOPE})),
            "none": (),
            "expired": _bearer(mint_dev_token(secret, "alice", ttl_s=-3600)),
            "garbage": _bearer("garbage"),
        }
        alice, bob = rig.callers["alice"], rig.callers["bob"]
        stub = rig.stub
        for ref, metadata in (("@alice", alice), ("@alice-2", alice), ("@bob", bob)):
            rig.refs[ref] = await _create(stub, metadata, ref)
        for ref, session in (("@alice-turn", "@alice"), ("@bob-turn", "@bob")):
            sent = await stub.SendMessage(
                pb.SendMessageRequest(
                    session_id=rig.refs[session], text="hello", request_id=f"seed-{ref}"
                ),
                metadata=alice if session == "@alice" else bob,
            )
            rig.refs[ref] = sent.turn.turn_id
        listed = await stub.ListSessions(
            pb.ListSessionsRequest(project_id="demo", page_size=1), metadata=alice
        )
        rig.refs["@sessions-token"] = listed.next_page_token
        transcript = await stub.ListMessages(
            pb.ListMessagesRequest(session_id=rig.refs["@alice"], page_size=1), metadata=alice
        )
        rig.refs["@messages-token"] = transcript.next_page_token
        for ref in ("@sessions-token", "@messages-token"):
            token = rig.refs[ref]
            assert token
            rig.refs[f"{ref}~"] = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
        yield rig
        await check_afterwards(rig)
        await rig.channel.close()
    finally:
        logging.getLogger().removeHandler(errors)
        if served is not None:
            served.stop()
        await stack.stop()
        pg_cluster.drop_database(database)


async def _create(stub: Any, metadata: tuple[tuple[str, str], ...], request_id: str) -> str:
    response = await stub.CreateSession(
        pb.CreateSessionRequest(request_id=request_id, project_id="demo", title="t"),
        metadata=metadata,
    )
    return str(response.session.session_id)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _resolve(rig: Rig, request: message.Message) -> message.Message:
    """The request with placeholders replaced by the rig's real ids (``@fresh``: a new
    session of alice's, made for this example)."""
    resolved = type(request)()
    resolved.CopyFrom(request)
    holders = [resolved]
    if isinstance(resolved, pb.UpdateSessionRequest):
        holders.append(resolved.session)  # type: ignore[arg-type]
    for holder in holders:
        for fd, value in holder.ListFields():
            if fd.type != descriptor.FieldDescriptor.TYPE_STRING or not isinstance(value, str):
                continue
            if value == "@fresh":
                fresh = await _create(rig.stub, rig.callers["alice"], uuid.uuid4().hex)
                setattr(holder, fd.name, fresh)
            elif value in rig.refs:
                setattr(holder, fd.name, rig.refs[value])
    return resolved


def _payload(example: Example, request: message.Message) -> bytes:
    if example.raw is not None:
        return example.raw
    data = request.SerializeToString()
    if example.spoil is not None:
        paths = list(string_paths(request.DESCRIPTOR))
        index, junk = example.spoil
        # Appended, it is the field's last occurrence: the one a decoder keeps.
        data += encoded(paths[index % len(paths)], junk)
    return data


async def run_example(rig: Rig, name: str, example: Example) -> None:
    request = await _resolve(rig, example.request)
    call = rig.channel.unary_unary(f"/{SERVICE.full_name}/{name}")
    payload = _payload(example, request)
    try:
        await call(payload, metadata=rig.callers[example.caller], timeout=30)
    except grpc.aio.AioRpcError as error:
        code = error.code()
        assert code not in BUG_CODES, (name, example, error)
        if len(payload) > RECEIVE_LIMIT:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, error)
            event("over the receive limit")
            return
        status = rpc_status.from_call(error)
        assert status is not None, (name, example, error)
        infos = [d for d in status.details if d.TypeName() == "google.rpc.ErrorInfo"]
        assert len(infos) == 1, (name, example, status)
        reason = _reason(status)
        event(f"{code.name} {reason}")
    else:
        event("OK")
    event("spoiled" if example.spoil else "random bytes" if example.raw is not None else "plain")


def _reason(status: Any) -> str:
    info = error_details_pb2.ErrorInfo()
    for detail in status.details:
        if detail.Unpack(info):
            assert info.domain == "planner.ballet", status
            return str(info.reason)
    return ""


async def check_afterwards(rig: Rig) -> None:
    """The planner still serves, and no turn is left running (SendMessage waits for its
    turn's end, so none may be)."""
    health = health_pb2_grpc.HealthStub(rig.channel)
    response = await health.Check(health_pb2.HealthCheckRequest())
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    engine = make_engine(rig.stack.database_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            running = await conn.execute(text("SELECT count(*) FROM turns WHERE state = 'running'"))
            assert running.scalar_one() == 0
    finally:
        await engine.dispose()


def family(name: str) -> Any:
    """The property test of one RPC: ``EXAMPLES`` examples, none reaching a bug code."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(example=examples(name))
    async def test(rig: Rig, example: Example) -> None:
        await run_example(rig, name, example)
        assert not rig.new_errors(), (name, example)

    test.__name__ = f"test_{name}_input_never_reaches_an_internal_error"
    return test


test_CreateSession = family("CreateSession")
test_GetSession = family("GetSession")
test_ListSessions = family("ListSessions")
test_UpdateSession = family("UpdateSession")
test_DeleteSession = family("DeleteSession")
test_ListMessages = family("ListMessages")
test_GetTurn = family("GetTurn")
test_CancelTurn = family("CancelTurn")
test_SendMessage = family("SendMessage")


def test_every_unary_rpc_has_its_family() -> None:
    assert {name[len("test_") :] for name in globals() if name[5:] in METHODS} == set(METHODS)
