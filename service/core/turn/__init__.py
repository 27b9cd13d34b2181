"""The turn: from a human message to its stored end (docs/spec/turn-loop.md, docs/spec/authority.md,
docs/spec/compaction.md and docs/spec/api-and-streams.md).

Who owns what (docs/architecture.md has the whole map):

- ``service.py``: ``TurnService``, what the transport calls: send (store the message and
  open the turn, then launch it), cancel, wait, start-up recovery, graceful shutdown.
- ``leases.py``: lease renewal and the sweeper (ownership across replicas).
- ``loop.py``: ``TurnLoop``, the step machine (``Prepare``, ``Compact``, ``CallModel``,
  ``RunTools``, ``End``) and the one place that checks stop, max rounds and timeout.
- ``model_call.py``: one model request and its streamed answer; the planner's own id for
  every tool call.
- ``tool_round.py``: running one round's calls and storing their results.
- ``compact.py``: the compaction step and the model's context besides the messages
  (the system-side summary and pending changesets, the context estimate).
- ``pending.py``: the changesets the session proposed that still wait for the human.
- ``ending.py``: the one ending, for the loop, recovery, start-up and shutdown alike.
- ``telling.py``: store, then tell: a turn's commit, then its publication and the
  ending's count (``StoreThenTell``).
- ``events.py``: typed builders of every session event.
- ``prompt.py``: the system prompt and its cache.
- ``state.py``: the handle the service holds and the state only the loop touches.
- ``settings.py``: the frozen settings, dependencies and the metrics hooks.
"""

from service.core.turn.ending import Ending
from service.core.turn.loop import CallModel, Compact, End, Prepare, RunTools, Step
from service.core.turn.service import Accepted, SendRequest, TurnService
from service.core.turn.settings import NullObserver, TurnDependencies, TurnObserver, TurnSettings

__all__ = [
    "Accepted",
    "CallModel",
    "Compact",
    "End",
    "Ending",
    "NullObserver",
    "Prepare",
    "RunTools",
    "SendRequest",
    "Step",
    "TurnDependencies",
    "TurnObserver",
    "TurnService",
    "TurnSettings",
]
