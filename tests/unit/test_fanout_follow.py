"""The hub says which sessions this process follows (decision 0231): a session is
followed from its first stream's attach to its last stream's leaving, so the notifier
listens to the notifications of the sessions streamed here and no others."""

from __future__ import annotations

from service.core.fanout import Hub
from service.core.model import SessionEvent


async def no_events(session_id: str, after: int, limit: int) -> list[SessionEvent]:
    return []


class Follows:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.followed: set[str] = set()

    def follow(self, session_id: str) -> None:
        assert session_id not in self.followed
        self.followed.add(session_id)
        self.calls.append(("follow", session_id))

    def unfollow(self, session_id: str) -> None:
        assert session_id in self.followed
        self.followed.discard(session_id)
        self.calls.append(("unfollow", session_id))


def watched() -> tuple[Hub, Follows]:
    hub, follows = Hub(no_events), Follows()
    hub.on_follow(follows.follow, follows.unfollow)
    return hub, follows


async def test_a_session_is_followed_from_its_first_stream_to_its_last() -> None:
    hub, follows = watched()
    first = hub.attach("s1", "alice", 0)
    second = hub.attach("s1", "bob", 0)
    bound = hub.new_queue("alice")
    assert follows.calls == [("follow", "s1")]
    hub.bind(bound, "s2", 0)
    assert follows.followed == {"s1", "s2"}
    hub.detach(first)
    assert follows.followed == {"s1", "s2"}
    hub.detach(second)
    hub.detach(second)  # idempotent
    assert follows.followed == {"s2"}
    hub.detach(bound)
    assert follows.calls[-1] == ("unfollow", "s2")
    assert follows.followed == set()


async def test_a_deleted_session_and_a_shutdown_unfollow() -> None:
    hub, follows = watched()
    queue = hub.attach("s1", "alice", 0)
    hub.attach("s2", "alice", 0)
    hub.session_deleted("s1")
    assert follows.followed == {"s2"}
    hub.detach(queue)  # its stream leaves after the NOT_FOUND: nothing more to unfollow
    hub.session_deleted("s3")  # never followed
    hub.close_all(None)
    assert follows.followed == set()
    assert follows.calls == [
        ("follow", "s1"),
        ("follow", "s2"),
        ("unfollow", "s1"),
        ("unfollow", "s2"),
    ]
