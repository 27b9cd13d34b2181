"""The conversation the model sees, kept between model calls.

``context.to_model_messages`` converts a session's messages after the summary into the
model's messages: O(n) in the messages, on both model calls of every round. Without a
compaction (a model that reports small usage, or a large ``compact_at_tokens``) a
session of 1,000 turns made every model call convert about 5,000 messages again.

The messages of turns that have ended never change: only the running turn adds messages
(one running turn per session, docs/spec/api-and-streams.md), and its first message is the human's.
So
``Conversations`` keeps, per session, the converted messages of everything before the
running turn's human message, and converts only the running turn's messages on each
call. The kept part is valid while the messages before the running turn are the same:
checked by their count and the sequences of the first and the last (the messages after
the summary are a contiguous run of the session's transcript, and sequences are unique
in a session), so a compaction, another replica's turn or a deleted and re-created
session is never served from a stale entry. When a turn has ended since, the kept part
is a prefix of the new one (same first message, its last message at the same place) and
only the newly ended turn is converted. The same ``ModelMessage`` objects are returned
for as long as they are kept, so an adapter may memoize their encoding by identity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from service.core.context import to_model_messages
from service.core.model import Message, MessageKind
from service.core.ports.model import ModelMessage

#: Sessions whose conversation is kept; past it the least recently used goes first.
DEFAULT_MAX_SESSIONS = 1024
#: Bytes of kept conversations in all (the replica passes its context bound,
#: ``database.context_cache_bytes``); past it the least recently used session goes first.
DEFAULT_MAX_BYTES = 64 << 20
#: Bytes counted per kept message besides its text: the model message, its tuple of
#: calls, and the gateway client's encoding entry and weak reference (tracemalloc
#: measured about 630 for a short message).
MESSAGE_OVERHEAD = 600

_Key = tuple[int, int, int]


class _Kept:
    __slots__ = ("key", "messages", "size")

    def __init__(self, key: _Key, messages: list[ModelMessage], size: int) -> None:
        self.key = key
        self.messages = messages
        self.size = size


class Conversations:
    """Per session: the model's messages of the turns before the running one, every
    session's from its second turn on, at most ``max_sessions`` sessions and
    ``max_bytes`` bytes in all (0: nothing kept). A message counts its text twice (the
    model message shares the stored message's strings; the gateway client's encoding
    copies them) and ``MESSAGE_OVERHEAD``.

    Owned by the turn service of one replica; used from its event loop only.
    """

    def __init__(
        self, max_sessions: int = DEFAULT_MAX_SESSIONS, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self._max_sessions = max_sessions
        self._max_bytes = max_bytes
        self._bytes = 0
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    @property
    def sessions(self) -> int:
        """How many sessions' conversations are kept."""
        return len(self._kept)

    @property
    def bytes(self) -> int:
        """The bytes counted for the kept conversations (see the class docstring)."""
        return self._bytes

    def model_messages(self, session_id: str, messages: Sequence[Message]) -> list[ModelMessage]:
        """``to_model_messages(messages)``, converting only the running turn's messages
        when the earlier ones were converted before (see the module docstring)."""
        start = _running_turn_start(messages)
        earlier = messages[:start]
        key = _key(earlier)
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            self._bytes -= kept.size
        if key is None or self._max_bytes <= 0:
            return to_model_messages(messages)
        if kept is not None and kept.key == key:
            converted, size = kept.messages, kept.size
        elif kept is not None and _extends(kept.key, earlier):
            # Turns ended since: convert only theirs (they start with a human message).
            ended = earlier[kept.key[0] :]
            converted = [*kept.messages, *to_model_messages(ended)]
            size = kept.size + _size(ended)
        else:
            converted, size = to_model_messages(earlier), _size(earlier)
        if size <= self._max_bytes:
            self._kept[session_id] = _Kept(key, converted, size)
            self._bytes += size
            while len(self._kept) > self._max_sessions or self._bytes > self._max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.size
        return [*converted, *to_model_messages(messages[start:])]


def _size(messages: Sequence[Message]) -> int:
    return sum(2 * message.size_bytes() + MESSAGE_OVERHEAD for message in messages)


def _running_turn_start(messages: Sequence[Message]) -> int:
    """The index of the last human message (the running turn's first), or 0."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].kind is MessageKind.HUMAN:
            return index
    return 0


def _extends(key: _Key, earlier: Sequence[Message]) -> bool:
    """Whether the messages ``key`` names are a prefix of ``earlier`` that ends where a
    turn ends (the next message is a human's)."""
    count, first, last = key
    return (
        count < len(earlier)
        and earlier[0].sequence == first
        and earlier[count - 1].sequence == last
        and earlier[count].kind is MessageKind.HUMAN
    )


def _key(earlier: Sequence[Message]) -> _Key | None:
    """What identifies ``earlier``; None when there is nothing to keep, or a message is
    not stored yet (sequence 0) and so cannot be told apart."""
    if not earlier:
        return None
    first, last = earlier[0].sequence, earlier[-1].sequence
    if first <= 0 or last <= 0:
        return None
    return (len(earlier), first, last)
