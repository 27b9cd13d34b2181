"""The compaction step (seed: Context compaction; SPEC section 6; decision 0060).

Before each model call the loop asks ``Compactor.maybe_compact``: above
``planner.compact_at_tokens`` it summarizes everything before the latest human message
(the earlier summary included), folding text larger than
``compaction_input_max_tokens`` in chunks from the oldest end, and stores the summary,
its ``up_to``, the compaction marker and the ``compacted`` event in one commit. A failed
compaction changes nothing stored; the call proceeds uncompacted and no further
compaction is tried in the same turn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from service.core import prompts
from service.core.compaction import (
    chunk_blocks,
    compaction_prompt,
    estimate_tokens,
    looks_like_failure,
    plan_compaction,
    render_transcript,
    tokens_for_bytes,
)
from service.core.errors import ModelFailure
from service.core.model import ContextEstimate, Message, SessionEvent, Usage
from service.core.ports import ModelMessage, Purpose, Role, SummaryUpdate, TurnPatch
from service.core.turn.model_call import model_request, stream_answer
from service.core.turn.prompt import Prompt
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import TurnState

log = logging.getLogger(__name__)

#: Stores a compaction: its event, the summary, the new estimate (raises ``Abandon``).
CommitCompaction = Callable[
    [list[SessionEvent], TurnPatch, SummaryUpdate, ContextEstimate], Awaitable[object]
]


class Compactor:
    """Compacts a turn's context when the estimate is over the threshold."""

    def __init__(self, deps: TurnDependencies, state: TurnState, commit: CommitCompaction) -> None:
        self._deps = deps
        self._state = state
        self._commit = commit

    async def maybe_compact(self, prompt: Prompt) -> None:
        """Compact if the estimate is above ``compact_at_tokens`` and a compaction would
        move ``up_to`` forward; raises what ``commit`` raises."""
        state, settings = self._state, self._deps.settings
        if state.compaction_failed:
            return
        fixed = prompt.fixed_bytes + len(state.summary.encode())
        estimated = estimate_tokens(state.context, fixed_bytes=fixed)
        if estimated <= settings.compact_at_tokens:
            return
        plan = plan_compaction(
            state.messages, human_sequence=state.handle.human_sequence, summary=state.summary
        )
        if plan is None:
            return
        started = time.monotonic()
        try:
            summary, usage = await self._summarize(prompt, plan.previous_summary, plan.messages)
        except ModelFailure as failure:
            self._failed(failure.reason)
            self._deps.observer.model_called(
                "compaction", failure.reason, time.monotonic() - started, None
            )
            return
        if summary is None:
            return
        if looks_like_failure(summary):
            self._failed("an empty or error summary")
            return
        kept = [m for m in state.messages if m.sequence > plan.up_to]
        base = (
            usage.output_tokens
            if usage is not None and usage.output_tokens
            else tokens_for_bytes(len(summary.encode()))
        )
        context = ContextEstimate(base_tokens=base, pending_bytes=sum(m.size_bytes() for m in kept))
        compaction_usage = state.compaction_usage + (usage or Usage())
        await self._commit(
            [state.events.compacted(plan.up_to, estimated)],
            TurnPatch(compaction_usage=compaction_usage),
            SummaryUpdate(summary, plan.up_to),
            context,
        )
        state.summary = summary
        state.summary_up_to = plan.up_to
        state.messages = kept
        state.context = context
        state.compaction_usage = compaction_usage
        self._deps.observer.compacted()
        log.info(
            "compacted up_to=%d estimated_tokens=%d",
            plan.up_to,
            estimated,
            extra=state.handle.log_fields(),
        )

    def _failed(self, why: str) -> None:
        self._state.compaction_failed = True
        self._deps.observer.compaction_failed()
        log.warning(
            "compaction failed (%s); continuing uncompacted",
            why,
            extra=self._state.handle.log_fields(),
        )

    async def _summarize(
        self, prompt: Prompt, previous: str, messages: Sequence[Message]
    ) -> tuple[str | None, Usage | None]:
        """Fold ``messages`` into ``previous``, oldest first, in chunks that fit.

        Returns ``(None, None)`` when the turn was asked to stop meanwhile; raises
        ``ModelFailure``.
        """
        settings = self._deps.settings
        instructions = settings.summary_instructions or prompts.summary_instructions()
        summary = previous
        total: Usage | None = None
        chunks = chunk_blocks(
            render_transcript(messages),
            max_tokens=settings.compaction_input_max_tokens,
            reserved_tokens=tokens_for_bytes(len(instructions.encode()) + 4 * 1024),
        )
        for chunk in chunks:
            request = model_request(
                self._deps,
                self._state,
                purpose=Purpose.COMPACTION,
                credential_ref=prompt.credential_ref,
                system=instructions,
                messages=[ModelMessage(Role.USER, compaction_prompt(summary, chunk))],
                tools=(),
            )
            streamed = await stream_answer(self._deps, self._state, request, relay=False)
            if streamed.stopped:
                return None, None
            if streamed.failure is not None:
                raise streamed.failure
            answer = streamed.answer
            if looks_like_failure(answer.text):
                return answer.text, answer.usage
            summary = answer.text.strip()
            if answer.usage is not None:
                total = answer.usage if total is None else total + answer.usage
        return summary, total
