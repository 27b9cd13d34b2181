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

#: Sessions whose conversation is kept, and model messages kept in all; past either the
#: least recently used session goes first.
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_MESSAGES = 100_000
#: A conversation shorter than this (before the running turn) is converted again rather
#: than kept: converting it costs about a millisecond, and keeping every short session's
#: messages (and their encodings) would cost memory for nothing.
MIN_KEPT_MESSAGES = 256

_Key = tuple[int, int, int]


class Conversations:
    """Per session: the model's messages of the turns before the running one.

    Owned by the turn service of one replica; used from its event loop only.
    """

    def __init__(
        self,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        min_messages: int | None = None,
    ) -> None:
        self._min_messages = MIN_KEPT_MESSAGES if min_messages is None else min_messages
        self._max_sessions = max_sessions
        self._max_messages = max_messages
        self._messages = 0
        self._kept: OrderedDict[str, tuple[_Key, list[ModelMessage]]] = OrderedDict()

    @property
    def sessions(self) -> int:
        """How many sessions' conversations are kept."""
        return len(self._kept)

    def model_messages(self, session_id: str, messages: Sequence[Message]) -> list[ModelMessage]:
        """``to_model_messages(messages)``, converting only the running turn's messages
        when the earlier ones were converted before (see the module docstring)."""
        start = _running_turn_start(messages)
        earlier = messages[:start]
        key = _key(earlier)
        if key is None or len(earlier) < self._min_messages:
            self._forget(session_id)
            return to_model_messages(messages)
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            self._messages -= len(kept[1])
        if kept is not None and kept[0] == key:
            converted = kept[1]
        elif kept is not None and _extends(kept[0], earlier):
            # Turns ended since: convert only theirs (they start with a human message).
            converted = [*kept[1], *to_model_messages(earlier[kept[0][0] :])]
        else:
            converted = to_model_messages(earlier)
        self._kept[session_id] = ((len(earlier), key[1], key[2]), converted)
        self._messages += len(converted)
        while self._kept and (
            len(self._kept) > self._max_sessions or self._messages > self._max_messages
        ):
            _, (_, dropped) = self._kept.popitem(last=False)
            self._messages -= len(dropped)
        return [*converted, *to_model_messages(messages[start:])]


    def _forget(self, session_id: str) -> None:
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            self._messages -= len(kept[1])


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
