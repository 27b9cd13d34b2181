"""Two replicas on one durable cluster (fsync on) with a NOTIFYing commit stalled
elsewhere in it (``tests.notify_stall``): turns go on, and a stream on the other replica
gets every event, healed by sequence; a session streamed on one replica only is signalled
to nobody (decision 0340).

The cluster's commits are flushed locally (``synchronous_commit = local``); the stalled
transaction alone asks for its synchronous standby, which never comes.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from tests.notify_stall import durable_stalling_cluster, stalled_notify
from tests.pg import PgCluster
from tests.replicas.support import END, ChatStream, Planner, Rig, rig, sequences

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

#: With a NOTIFYing commit stalled in the cluster, turns complete within 10 s and a
#: stream on the other replica receives the events within 5 s of turn_ended.
TURN_LIMIT_S = 10.0
FOLLOW_LIMIT_S = 5.0
#: Turns run one after another while the stall holds.
TURNS = 3

SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human"},
            "reply": {
                "text": "Let me look.",
                "tool_calls": [{"name": "list_items", "arguments": {"kind": "epic"}}],
            },
        },
        {"match": {"last_role": "tool"}, "reply": {"text": "Three epics are open."}},
    ]
}

_METRICS = re.compile(r"\(metrics (\S+), replica")


@pytest.fixture(scope="module")
async def stalling(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Rig, str]]:
    """Both planners on a durable cluster that can stall a NOTIFY; its URL."""
    cluster = await asyncio.to_thread(PgCluster.temporary)
    try:
        await asyncio.to_thread(durable_stalling_cluster, cluster)
        cluster.create_database("planner")
        url = cluster.url("planner")
        async with rig(
            tmp_path_factory.mktemp("stall"),
            url,
            SCENARIO,
            planner={"heal_interval_s": 1.0},
            server={"metrics_address": "127.0.0.1:0"},
        ) as r:
            yield r, url
    finally:
        await asyncio.to_thread(cluster.destroy)


def metric(planner: Planner, name: str, labels: str = "") -> float:
    """One sample of ``planner``'s /metrics (0 when absent)."""
    found = _METRICS.search(planner.log_text())
    assert found, "the planner did not say where its metrics are"
    with urllib.request.urlopen(f"http://{found.group(1)}/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


async def events_handled(planner: Planner) -> float:
    return await asyncio.to_thread(
        metric, planner, "ballet_planner_notifications_handled_total", 'kind="events"'
    )


async def signals_sent_or_failed(planner: Planner) -> float:
    total = 0.0
    for outcome in ("sent", "failed"):
        total += await asyncio.to_thread(
            metric, planner, "ballet_planner_signals_total", f'outcome="{outcome}"'
        )
    return total


async def test_turns_and_a_follower_on_the_other_replica_go_on_while_notify_is_stalled(
    stalling: tuple[Rig, str], record_property: Callable[[str, object], None]
) -> None:
    r, url = stalling
    session_id = await r.a.create_session(r.alice, f"stall-{uuid.uuid4().hex}")
    on_a, on_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
    on_a.attach(session_id)
    on_b.attach(session_id)
    await asyncio.gather(on_a.opened(), on_b.opened())
    turn_s: list[float] = []
    follow_s: list[float] = []
    async with stalled_notify(url):
        for n in range(TURNS):
            on_a.say(f"what is open? ({n})", f"send-{n}")
            accepted = await on_a.wait_kind("message_accepted", count=n + 1)
            turn_id = accepted.response.turn_id
            ended_a = await on_a.turn_ended(turn_id, timeout_s=TURN_LIMIT_S)
            assert ended_a.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
            ended_b = await on_b.turn_ended(turn_id, timeout_s=FOLLOW_LIMIT_S)
            turn_s.append(ended_a.at - accepted.at)
            follow_s.append(ended_b.at - ended_a.at)
    record_property("turn_max_s", round(max(turn_s), 3))
    record_property("follower_after_turn_ended_max_s", round(max(follow_s), 3))
    # Every event, in order, without gaps, on both replicas.
    events_a, events_b = on_a.events(), on_b.events()
    assert sequences(events_a) == list(range(1, len(events_a) + 1))
    assert sequences(events_b) == sequences(events_a)
    healed = await asyncio.to_thread(metric, r.b, "ballet_planner_notifications_healed_total")
    assert healed >= 1
    await on_a.close()
    await on_b.close()


async def test_no_notification_is_sent_or_handled_for_a_session_only_its_replica_streams(
    stalling: tuple[Rig, str],
) -> None:
    r, _ = stalling
    busy = await r.a.create_session(r.alice, f"busy-{uuid.uuid4().hex}")
    quiet = await r.a.create_session(r.alice, f"quiet-{uuid.uuid4().hex}")
    on_a, on_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
    on_a.attach(busy)
    on_b.attach(quiet)  # B streams a session, just not the busy one
    await asyncio.gather(on_a.opened(), on_b.opened())
    before_a, before_b = await events_handled(r.a), await events_handled(r.b)
    signalled_a = await signals_sent_or_failed(r.a)
    for n in range(TURNS):
        on_a.say(f"what is open? ({n})", f"busy-{n}")
        accepted = await on_a.wait_kind("message_accepted", count=n + 1)
        await on_a.turn_ended(accepted.response.turn_id, timeout_s=TURN_LIMIT_S)
    # Nobody else follows the busy session: A sends no notification for it (decision
    # 0340), so neither A's listener nor B's reads one.
    assert await signals_sent_or_failed(r.a) == signalled_a
    assert await events_handled(r.a) == before_a
    assert await events_handled(r.b) == before_b
    assert on_b.events() == []
    await on_a.close()
    await on_b.close()
