"""A running turn's two halves: the ``TurnHandle`` the turn service holds (ids, the stop
signal, the end), and the ``TurnRun`` only the loop touches (what the model sees, what
the turn used, the answer streaming now)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.core.model import ContextEstimate, Message, Session, Turn, Usage
from service.core.ports import Acting, FinishReason, TurnPatch
from service.core.turn.ending import Ending
from service.core.turn.events import EventBuilder, Totals

if TYPE_CHECKING:
    from service.core.turn.early import EarlyCall


class TurnHandle:
    """What the turn service and the lease renewer hold of a turn this replica runs.

    ``request_stop`` asks the loop to end the turn with an ``Ending`` (cancel, shutdown,
    lost lease, timeout); the first request wins. ``done`` is set once the loop has
    finished, however it finished.
    """

    def __init__(self, turn: Turn, session: Session, acting: Acting, human_sequence: int) -> None:
        self.turn = turn
        self.session = session
        self.acting = acting
        self.human_sequence = human_sequence
        self.stop: Ending | None = None
        #: A JOIN message waits to join the next model request (decision 0303): set by
        #: the service (this replica), the cancel signal or the lease renewal.
        self.join_pending = False
        #: A model call opened while what it follows committed: the turn's first, while
        #: its start commits (decision 0380), or the call after a round, while the
        #: round's last results commit (decision 0391). The loop takes it over or
        #: cancels it.
        self.early: EarlyCall | None = None
        self.done = asyncio.Event()
        self._on_stop: list[Callable[[], object]] = []

    def drop_early(self) -> None:
        """Cancel the model call opened ahead when nothing took it over (decisions 0380,
        0391)."""
        early, self.early = self.early, None
        if early is not None:
            early.cancel()

    def request_stop(self, ending: Ending) -> None:
        """Ask the loop to end the turn with ``ending`` at its next step (at once while
        the model streams or tools run)."""
        if self.stop is None:
            self.stop = ending
        callbacks, self._on_stop = self._on_stop, []
        for callback in callbacks:
            callback()

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self.stop is not None

    def on_stop(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` once when a stop is requested (at once if one was); returns
        a function that forgets it. Cheaper than a task waiting on an event."""
        if self.stop is not None:
            callback()
            return _nothing
        self._on_stop.append(callback)

        def forget() -> None:
            if callback in self._on_stop:
                self._on_stop.remove(callback)

        return forget

    @property
    def turn_id(self) -> str:
        return self.turn.turn_id

    @property
    def session_id(self) -> str:
        return self.session.session_id

    def log_fields(self) -> dict[str, str]:
        """The context fields of ``service/server/logs.py``; never content
        (docs/spec/operations.md)."""
        return {
            "session": self.session.session_id,
            "turn": self.turn.turn_id,
            "project": self.session.project_id,
            "actor": self.acting.actor,
        }


def _nothing() -> None:
    pass


@dataclass
class PendingCall:
    """A tool call of the answer streaming now, under the planner's id ``call_id``;
    ``arguments`` is empty until the call is complete. ``problem`` says why a call the
    gateway sent malformed cannot run (it gets an error result instead)."""

    call_id: str
    name: str
    provider_call_id: str = ""
    arguments: str = ""
    complete: bool = False
    problem: str = ""
    #: The answer stopped at its output limit inside this call (decision 0292).
    cut: bool = False


@dataclass
class Answer:
    """One streamed model answer as it builds up.

    Text arrives in pieces joined once, when read; ``calls`` are keyed by their index in
    the answer. ``finish`` is the provider's reason (None until the stream finished).
    """

    message_id: str
    parts: list[str] = field(default_factory=list)
    length: int = 0
    calls: dict[int, PendingCall] = field(default_factory=dict)
    finish: FinishReason | None = None
    usage: Usage | None = None
    #: The model that answered, as the server reported it ("" when it did not).
    model: str = ""

    def add_text(self, text: str) -> int:
        """Append a piece; returns its offset in characters."""
        offset = self.length
        self.parts.append(text)
        self.length += len(text)
        return offset

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def complete_calls(self) -> list[PendingCall]:
        """The complete calls, in index order."""
        return [self.calls[i] for i in sorted(self.calls) if self.calls[i].complete]


@dataclass
class TurnRun:
    """The mutable state of one turn; owned by its loop alone.

    ``messages`` are the messages after the summary (what the model sees besides the
    system prompt), the turn's own included as they are stored; ``context`` is the
    running context estimate (docs/spec/compaction.md). ``context_block`` is the system-side context
    after a compaction (the summary and the pending changesets, decision 0172), with
    its estimated ``context_block_tokens``; ``request_estimate`` is the estimate of the
    next request when it was made without reported usage (for the estimator's error
    metric), else None, and ``request_raw_estimate`` the same before the calibration
    (what the calibration learns from, decision 0350). The compaction step keeps these.
    """

    handle: TurnHandle
    events: EventBuilder
    session: Session
    summary: str = ""
    summary_up_to: int = 0
    messages: list[Message] = field(default_factory=list)
    context: ContextEstimate = field(default_factory=ContextEstimate)
    rounds: int = 0
    usage: Usage = field(default_factory=Usage)
    compaction_usage: Usage = field(default_factory=Usage)
    writes: int = 0
    compaction_failed: bool = False
    context_block: str = ""
    context_block_tokens: int = 0
    request_estimate: int | None = None
    request_raw_estimate: int | None = None
    credential_expired: bool = False
    versions: TurnPatch = field(default_factory=TurnPatch)
    #: Whether the turn's streams were sent a delta yet (its time to first delta).
    delta_sent: bool = False
    #: What the turn spent of its budgets (decision 0291): model calls made (compaction
    #: included), tool calls run, and input plus output tokens of its model calls (as
    #: reported, else as estimated).
    model_requests: int = 0
    tool_calls: int = 0
    tokens_spent: int = 0
    #: A call of this turn was refused for ``turn_max_tool_calls``: the turn ends
    #: ``BUDGET_EXHAUSTED`` before its next model call.
    tool_budget_refused: bool = False
    #: Answers of the turn cut at the output limit inside a tool call (decision 0292).
    cut_answers: int = 0

    @property
    def totals(self) -> Totals:
        return Totals(self.rounds, self.usage, self.compaction_usage, self.writes)
