"""The tracker backend on the demo project: items, pagination, runnable tickets, search,
changesets (idempotency, validation, attribution). docs/spec/authority.md and README.md."""

from __future__ import annotations

import asyncio
import uuid

import grpc
from ballet.tracker.v1 import tracker_pb2

from ballet_common.tokens import KNOWLEDGE_AUDIENCE, TRACKER_AUDIENCE
from devstack.server import DevStack
from tests.devstack.fixtures import Clients, clients, demo_stack, metadata, rpc_error

__all__ = ["clients", "demo_stack"]

T = tracker_pb2


async def _all_items(stack: DevStack, clients: Clients, **filters: object) -> list[T.Item]:
    request = T.ListItemsRequest(project_id="demo", page_size=500, **filters)  # type: ignore[arg-type]
    response = await clients.tracker.ListItems(request, metadata=metadata(stack, "alice"))
    assert not response.next_page_token
    return list(response.items)


async def test_items_are_ordered_by_priority_then_id(
    demo_stack: DevStack, clients: Clients
) -> None:
    items = await _all_items(demo_stack, clients)
    assert len(items) == 21
    keys = [(item.priority, item.item_id) for item in items]
    assert keys == sorted(keys)


async def test_filters(demo_stack: DevStack, clients: Clients) -> None:
    epics = await _all_items(demo_stack, clients, kind=T.ITEM_KIND_EPIC)
    assert sorted(item.item_id for item in epics) == ["PAN-3", "PAN-4", "PAN-5", "PAN-6"]
    milestones = await _all_items(demo_stack, clients, kind=T.ITEM_KIND_MILESTONE)
    assert sorted(item.item_id for item in milestones) == ["PAN-1", "PAN-2"]
    pantry = await _all_items(demo_stack, clients, epic_id="PAN-4")
    assert sorted(item.item_id for item in pantry) == [
        "PAN-10",
        "PAN-11",
        "PAN-12",
        "PAN-13",
        "PAN-14",
    ]
    closed = await _all_items(demo_stack, clients, state=T.ITEM_STATE_CLOSED)
    assert sorted(item.item_id for item in closed) == ["PAN-10", "PAN-21", "PAN-7"]
    beta_tickets = await _all_items(
        demo_stack, clients, milestone_id="PAN-2", kind=T.ITEM_KIND_TICKET
    )
    assert sorted(item.item_id for item in beta_tickets) == [f"PAN-{n}" for n in range(15, 21)]
    refusal = await rpc_error(
        clients.tracker.ListItems(
            T.ListItemsRequest(project_id="demo", epic_id="PAN-11"),
            metadata=metadata(demo_stack, "alice"),
        )
    )
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "EPIC_NOT_FOUND")


async def test_pagination_walks_every_item_exactly_once(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    expected = [item.item_id for item in await _all_items(demo_stack, clients)]
    for size in (1, 4, 7, 20, 21):
        seen: list[str] = []
        token = ""
        while True:
            page = await clients.tracker.ListItems(
                T.ListItemsRequest(project_id="demo", page_size=size, page_token=token),
                metadata=alice,
            )
            assert page.total_size == len(expected)
            assert len(page.items) <= size
            seen += [item.item_id for item in page.items]
            token = page.next_page_token
            if not token:
                break
        assert seen == expected, size


async def test_bad_page_tokens_and_sizes_are_invalid_arguments(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    first = await clients.tracker.ListItems(
        T.ListItemsRequest(project_id="demo", page_size=3), metadata=alice
    )
    token = first.next_page_token
    tampered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    for request in (
        T.ListItemsRequest(project_id="demo", page_size=3, page_token=tampered),
        T.ListItemsRequest(project_id="demo", page_size=3, page_token="not a token"),
        # A token is bound to the filters it was issued for.
        T.ListItemsRequest(project_id="demo", page_token=token, kind=T.ITEM_KIND_TICKET),
    ):
        refusal = await rpc_error(clients.tracker.ListItems(request, metadata=alice))
        assert (refusal.code, refusal.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PAGE_TOKEN",
        )
    refusal = await rpc_error(
        clients.tracker.ListRunnableTickets(
            T.ListRunnableTicketsRequest(project_id="demo", page_token=token), metadata=alice
        )
    )
    assert refusal.reason == "INVALID_PAGE_TOKEN"
    refusal = await rpc_error(
        clients.tracker.ListItems(
            T.ListItemsRequest(project_id="demo", page_size=-1), metadata=alice
        )
    )
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_SIZE")
    # Page sizes above the maximum are coerced (AIP-158), not refused.
    big = await clients.tracker.ListItems(
        T.ListItemsRequest(project_id="demo", page_size=100_000), metadata=alice
    )
    assert len(big.items) == 21


async def test_get_item_has_details_and_dependencies(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    item = (
        await clients.tracker.GetItem(
            T.GetItemRequest(project_id="demo", item_id="PAN-19"), metadata=alice
        )
    ).item
    assert item.kind == T.ITEM_KIND_TICKET and item.ticket_type == "feature"
    assert (item.epic_id, item.milestone_id) == ("PAN-6", "PAN-2")
    assert sorted(item.blocked_by_ids) == ["PAN-18", "PAN-8"]
    assert "notification" in item.acceptance_criteria
    blocker = (
        await clients.tracker.GetItem(
            T.GetItemRequest(project_id="demo", item_id="PAN-11"), metadata=alice
        )
    ).item
    assert sorted(blocker.blocks_ids) == ["PAN-12", "PAN-14", "PAN-15"]
    assert list(blocker.blocked_by_ids) == ["PAN-10"]
    chore = (
        await clients.tracker.GetItem(
            T.GetItemRequest(project_id="demo", item_id="PAN-13"), metadata=alice
        )
    ).item
    assert chore.HasField("policy") and chore.policy.mode == "auto"
    for unknown in ("PAN-999", "OPS-1"):  # OPS-1 exists, in globex's project
        refusal = await rpc_error(
            clients.tracker.GetItem(
                T.GetItemRequest(project_id="demo", item_id=unknown), metadata=alice
            )
        )
        assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND")
        assert refusal.info.metadata["item_id"] == unknown


async def test_runnable_tickets_are_open_tickets_with_closed_blockers(
    demo_stack: DevStack, clients: Clients
) -> None:
    items = {item.item_id: item for item in await _all_items(demo_stack, clients)}
    expected = sorted(
        item.item_id
        for item in items.values()
        if item.kind == T.ITEM_KIND_TICKET
        and item.state == T.ITEM_STATE_OPEN
        and all(items[b].state == T.ITEM_STATE_CLOSED for b in item.blocked_by_ids)
    )
    assert expected == ["PAN-11", "PAN-13", "PAN-17", "PAN-18", "PAN-9"]
    seen: list[str] = []
    token = ""
    while True:
        page = await clients.tracker.ListRunnableTickets(
            T.ListRunnableTicketsRequest(project_id="demo", page_size=2, page_token=token),
            metadata=metadata(demo_stack, "bob"),
        )
        assert page.total_size == len(expected)
        seen += [item.item_id for item in page.items]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == expected
    assert seen[0] == "PAN-9"  # priority 0 first


async def test_search_fuses_keywords_and_trigrams(demo_stack: DevStack, clients: Clients) -> None:
    alice = metadata(demo_stack, "alice")

    async def top(query: str, **extra: object) -> T.SearchProjectResponse:
        response: T.SearchProjectResponse = await clients.tracker.SearchProject(
            T.SearchProjectRequest(project_id="demo", query=query, **extra),  # type: ignore[arg-type]
            metadata=alice,
        )
        return response

    found = await top("barcode")
    assert found.results[0].item.item_id == "PAN-12"
    assert found.items_searched and found.skills_searched
    assert found.results[0].score > 0
    # A typo no stemmer fixes: only the trigram signal finds it.
    typo = await top("barcod lookp")
    assert typo.results[0].item.item_id == "PAN-12"
    # Body words only (no title match): only the keyword signal finds it.
    body = await top("KDF")
    assert [result.item.item_id for result in body.results] == ["PAN-7"]
    assert "KDF" in body.results[0].snippet
    # An item id in the query ranks that item first.
    by_id = await top("what about PAN-17?")
    assert by_id.results[0].item.item_id == "PAN-17"
    skills = await top("release notes")
    hits = [result.skill for result in skills.results if result.HasField("skill")]
    assert [hit.name for hit in hits] == ["release-notes"]
    assert "demo project" in hits[0].description  # the project's skill hides the org's
    planning = await top("planning milestones")
    hit = next(r.skill for r in planning.results if r.HasField("skill"))
    # The project pins 1.0.0; only the resolved version is searched and reported.
    assert (hit.name, hit.version) == ("demo-planning", "1.0.0")
    scores = [result.score for result in (await top("pantry items list")).results]
    assert scores == sorted(scores, reverse=True)


async def test_search_pages_and_permissions(demo_stack: DevStack, clients: Clients) -> None:
    alice = metadata(demo_stack, "alice")
    request = T.SearchProjectRequest(project_id="demo", query="items household list", page_size=50)
    everything = await clients.tracker.SearchProject(request, metadata=alice)
    seen = []
    token = ""
    while True:
        page = await clients.tracker.SearchProject(
            T.SearchProjectRequest(
                project_id="demo", query="items household list", page_size=3, page_token=token
            ),
            metadata=alice,
        )
        seen += [r.item.item_id or r.skill.name for r in page.results]
        token = page.next_page_token
        if not token:
            break
    assert seen == [r.item.item_id or r.skill.name for r in everything.results]
    erin = await clients.tracker.SearchProject(
        T.SearchProjectRequest(project_id="demo", query="planning release barcode"),
        metadata=metadata(demo_stack, "erin"),  # skill.read only
    )
    assert (erin.items_searched, erin.skills_searched) == (False, True)
    assert erin.results and all(result.HasField("skill") for result in erin.results)
    refusal = await rpc_error(
        clients.tracker.SearchProject(
            T.SearchProjectRequest(project_id="demo", query="barcode"),
            metadata=metadata(demo_stack, "dave"),  # neither permission
        )
    )
    assert refusal.code == grpc.StatusCode.PERMISSION_DENIED
    refusal = await rpc_error(
        clients.tracker.SearchProject(T.SearchProjectRequest(project_id="demo"), metadata=alice)
    )
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "QUERY_REQUIRED")


def _dependency(item: str, blocker: str) -> T.ChangesetOperation:
    return T.ChangesetOperation(
        dependency=T.DependencyOperation(item_id=item, blocked_by_id=blocker)
    )


async def test_propose_changeset_is_idempotent_and_stays_proposed(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    request_id = f"call-{uuid.uuid4().hex}"
    request = T.ProposeChangesetRequest(
        request_id=request_id,
        project_id="demo",
        title="Barcode lookup needs search",
        description="Lookup reuses the search index.",
        operations=[_dependency("PAN-12", "PAN-14")],
    )
    first = (await clients.tracker.ProposeChangeset(request, metadata=alice)).changeset
    assert first.status == T.CHANGESET_STATUS_PROPOSED
    assert (first.author_id, first.recorded_by) == ("alice", "alice")
    assert list(first.operations) == list(request.operations)
    again = (await clients.tracker.ProposeChangeset(request, metadata=alice)).changeset
    assert again == first
    assert demo_stack.writes[request_id] == 1
    changed = T.ProposeChangesetRequest()
    changed.CopyFrom(request)
    changed.title = "Something else"
    refusal = await rpc_error(clients.tracker.ProposeChangeset(changed, metadata=alice))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")
    assert demo_stack.writes[request_id] == 1
    listed = await clients.tracker.ListChangesets(
        T.ListChangesetsRequest(project_id="demo", status=T.CHANGESET_STATUS_PROPOSED),
        metadata=metadata(demo_stack, "bob"),
    )
    assert first.changeset_id in [cs.changeset_id for cs in listed.changesets]
    applied = await clients.tracker.ListChangesets(
        T.ListChangesetsRequest(project_id="demo", status=T.CHANGESET_STATUS_APPLIED),
        metadata=alice,
    )
    assert not applied.changesets  # nothing applies a changeset
    # The plan itself did not change.
    item = await clients.tracker.GetItem(
        T.GetItemRequest(project_id="demo", item_id="PAN-12"), metadata=alice
    )
    assert list(item.item.blocked_by_ids) == ["PAN-11"]


async def test_concurrent_repeats_write_once(demo_stack: DevStack, clients: Clients) -> None:
    request = T.ProposeChangesetRequest(
        request_id=f"race-{uuid.uuid4().hex}",
        project_id="demo",
        title="Racing retries",
        operations=[_dependency("PAN-19", "PAN-13")],
    )
    alice = metadata(demo_stack, "alice")
    answers = await asyncio.gather(
        *(clients.tracker.ProposeChangeset(request, metadata=alice) for _ in range(8))
    )
    assert len({answer.changeset.changeset_id for answer in answers}) == 1
    assert demo_stack.writes[request.request_id] == 1


async def test_changesets_are_listed_newest_first_in_pages(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")
    made = []
    for index in range(5):
        response = await clients.tracker.ProposeChangeset(
            T.ProposeChangesetRequest(
                request_id=f"list-{uuid.uuid4().hex}",
                project_id="demo",
                title=f"Proposal {index}",
                operations=[_dependency("PAN-16", "PAN-13")],
            ),
            metadata=alice,
        )
        made.append(response.changeset.changeset_id)
    seen: list[str] = []
    token = ""
    while True:
        page = await clients.tracker.ListChangesets(
            T.ListChangesetsRequest(project_id="demo", page_size=2, page_token=token),
            metadata=alice,
        )
        seen += [changeset.changeset_id for changeset in page.changesets]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == len(set(seen))
    assert [cs for cs in seen if cs in made] == list(reversed(made))


async def test_changeset_references_are_checked(demo_stack: DevStack, clients: Clients) -> None:
    alice = metadata(demo_stack, "alice")

    async def propose(*operations: T.ChangesetOperation) -> T.Changeset:
        request = T.ProposeChangesetRequest(
            request_id=f"ref-{uuid.uuid4().hex}",
            project_id="demo",
            title="Refs",
            operations=list(operations),
        )
        response: T.ProposeChangesetResponse = await clients.tracker.ProposeChangeset(
            request, metadata=alice
        )
        return response.changeset

    created = await propose(
        T.ChangesetOperation(
            create_item=T.CreateItemOperation(
                ref="new-epic", kind=T.ITEM_KIND_EPIC, title="Recipes", milestone_id="PAN-2"
            )
        ),
        T.ChangesetOperation(
            create_item=T.CreateItemOperation(
                ref="new-ticket",
                kind=T.ITEM_KIND_TICKET,
                title="Suggest recipes from expiring items",
                ticket_type="feature",
                epic_id="new-epic",
            )
        ),
        _dependency("new-ticket", "PAN-18"),
        T.ChangesetOperation(update_item=T.UpdateItemOperation(item_id="PAN-20", priority=2)),
    )
    assert len(created.operations) == 4
    cases = [
        (_dependency("PAN-404", "PAN-13"), grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND"),
        (_dependency("later", "PAN-13"), grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND"),
        (_dependency("OPS-1", "PAN-13"), grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND"),
        (
            T.ChangesetOperation(
                create_item=T.CreateItemOperation(
                    kind=T.ITEM_KIND_TICKET, title="x", epic_id="PAN-11"
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "NOT_A_EPIC",
        ),
        (
            T.ChangesetOperation(update_item=T.UpdateItemOperation(item_id="PAN-404")),
            grpc.StatusCode.NOT_FOUND,
            "ITEM_NOT_FOUND",
        ),
        (_dependency("PAN-13", "PAN-13"), grpc.StatusCode.INVALID_ARGUMENT, "SELF_DEPENDENCY"),
        (T.ChangesetOperation(), grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_OPERATION"),
    ]
    for operation, code, reason in cases:
        refusal = await rpc_error(propose(operation))
        assert (refusal.code, refusal.reason) == (code, reason), operation
    refusal = await rpc_error(propose())
    assert refusal.reason == "OPERATIONS_REQUIRED"


async def test_actor_is_honoured_only_with_the_planner_credential(
    demo_stack: DevStack, clients: Clients
) -> None:
    def request() -> T.ProposeChangesetRequest:
        return T.ProposeChangesetRequest(
            request_id=f"actor-{uuid.uuid4().hex}",
            project_id="demo",
            title="Seed units first",
            operations=[_dependency("PAN-11", "PAN-13")],
        )

    planner = metadata(demo_stack, "alice", actor="planner:s-1", planner=TRACKER_AUDIENCE)
    changeset = (await clients.tracker.ProposeChangeset(request(), metadata=planner)).changeset
    assert (changeset.author_id, changeset.recorded_by) == ("alice", "planner:s-1")
    record = demo_stack.calls_for("ProposeChangeset")[-1]
    assert (record.human, record.actor, record.actor_header) == (
        "alice",
        "planner:s-1",
        "planner:s-1",
    )
    assert record.request_id

    ignored = [
        metadata(demo_stack, "alice", actor="planner:s-1"),  # no credential
        # Another service's valid credential for the tracker: verified, but not the planner.
        metadata(
            demo_stack,
            "alice",
            actor="planner:s-1",
            credential=demo_stack.planner_credential(TRACKER_AUDIENCE, subject="service:other"),
        ),
        # The planner's credential cannot make someone else's actor.
        metadata(demo_stack, "alice", actor="admin", planner=TRACKER_AUDIENCE),
    ]
    for md in ignored:
        changeset = (await clients.tracker.ProposeChangeset(request(), metadata=md)).changeset
        assert (changeset.author_id, changeset.recorded_by) == ("alice", "alice")
        record = demo_stack.calls_for("ProposeChangeset")[-1]
        assert record.actor == "" and record.actor_forged
    refused = {
        # A human's token is no service credential, whatever it claims.
        "TOKEN_INVALID": demo_stack.token("bob"),
        # The planner's credential for another dependency is refused here.
        "WRONG_AUDIENCE": demo_stack.planner_credential(KNOWLEDGE_AUDIENCE),
        "TOKEN_INVALID ": "junk",
    }
    for reason, credential in refused.items():
        md = metadata(demo_stack, "alice", actor="planner:s-1", credential=credential)
        refusal = await rpc_error(clients.tracker.ProposeChangeset(request(), metadata=md))
        assert (refusal.code, refusal.reason) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "SERVICE_CREDENTIAL_INVALID",
        )
        assert refusal.info.metadata["credential_reason"] == reason.strip()


async def test_the_planner_may_not_set_an_execution_policy(
    demo_stack: DevStack, clients: Clients
) -> None:
    operation = T.ChangesetOperation(
        update_item=T.UpdateItemOperation(item_id="PAN-18", policy=T.ExecutionPolicy(mode="auto"))
    )
    request = T.ProposeChangesetRequest(
        request_id=f"policy-{uuid.uuid4().hex}",
        project_id="demo",
        title="Automate the job",
        operations=[operation],
    )
    refusal = await rpc_error(
        clients.tracker.ProposeChangeset(
            request,
            metadata=metadata(demo_stack, "alice", actor="planner:s-2", planner=TRACKER_AUDIENCE),
        )
    )
    assert (refusal.code, refusal.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "POLICY_CHANGE_NOT_ALLOWED",
    )
    assert request.request_id not in demo_stack.writes
    # A human may (docs/spec/authority.md, "applying or rejecting one needs the human").
    response = await clients.tracker.ProposeChangeset(
        request, metadata=metadata(demo_stack, "alice")
    )
    assert response.changeset.operations[0].update_item.policy.mode == "auto"
