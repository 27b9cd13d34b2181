"""A replica that can no longer keep its leases lets its clients go (decision 0314):
every Chat stream ends ``UNAVAILABLE``/``REPLICA_UNAVAILABLE`` after what it was given,
with the session and the last sequence it got, so a gateway reopens it on another
replica with ``after_sequence`` and misses nothing."""

from __future__ import annotations

from service.core.errors import Unavailable
from service.core.fanout import Hub, StreamEnd
from tests.unit.test_fanout_overflow import drain, event, no_events


async def test_every_stream_ends_unavailable_with_where_to_resume() -> None:
    hub = Hub(no_events)
    following = hub.new_queue("alice")
    hub.bind(following, "s1", 7)
    hub.publish([event(8), event(9)])
    unopened = hub.new_queue("bob")
    assert hub.let_go("cannot reach the database") == 2
    items = await drain(following)
    assert items[:2] == [event(8), event(9)]  # what was queued is still sent
    end = items[-1]
    assert isinstance(end, StreamEnd) and isinstance(end.error, Unavailable)
    assert end.error.reason == "REPLICA_UNAVAILABLE"
    assert end.error.metadata == {"session_id": "s1", "last_sequence": "9"}
    other = (await drain(unopened))[-1]
    assert isinstance(other, StreamEnd) and isinstance(other.error, Unavailable)
    assert other.error.metadata == {}
    assert hub.let_go("again") == 0  # ended streams are not ended twice
