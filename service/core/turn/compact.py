"""The compaction step and the model's context (docs/spec/compaction.md;
decisions 0060, 0170 to 0172).

Before each model call the loop asks ``Compactor.maybe_compact``. It keeps what the model
sees besides the messages: the system-side context (the summary and, once there is one,
the changesets this session proposed that still wait for the human, read once per turn
and after a compaction), and the context estimate, which counts the fixed prompt and
that context at their current size whenever no usage is known. Above
``planner.compact_at_tokens`` it summarizes everything before the latest human message
(the earlier summary included), folding text larger than ``compaction_input_max_tokens``
in chunks from the oldest end, and stores the summary, its ``up_to``, the compaction
marker and the ``compacted`` event in one commit.

A summary is accepted only from a call that finished normally and when its text passes
``check_summary`` (no refusal, error or implausibly short text). A failed compaction is
logged (no content at INFO and above), counted by reason, and changes nothing stored but
the turn's compaction usage (the gateway metered the calls); the model call proceeds
uncompacted and no further compaction is tried in the same turn.

``answered`` compares each answer's reported input tokens with the estimate made without
reported usage for its request, for ``ballet_planner_context_estimate_ratio``, and
teaches the replica's ``TokenCalibration`` the model's count (decision 0350): such an
estimate is the raw one times what was learned.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from service.core import prompts
from service.core.compaction import (
    COMPACTION_REQUEST,
    SUMMARY_ROOM_TOKENS,
    CompactionPlan,
    chunk_blocks,
    compaction_framing,
    compaction_request_tokens,
    compaction_system_prompt,
    estimate_tokens,
    plan_compaction,
    render_transcript,
)
from service.core.context import context_block
from service.core.estimate import messages_tokens, text_tokens
from service.core.model import ContextEstimate, SessionEvent, Usage
from service.core.ports import ModelMessage, Purpose, Role, SummaryUpdate, TurnPatch
from service.core.summaries import Rejection, check_summary
from service.core.turn.ending import Ending
from service.core.turn.model_call import model_request, output_cap, stream_answer
from service.core.turn.pending import pending_changesets
from service.core.turn.prompt import Prompt
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import TurnRun

log = logging.getLogger(__name__)

#: Stores events, a turn patch and, for a compaction, the summary and the new estimate,
#: in one commit (raises the loop's ``Abandon``).
CommitCompaction = Callable[
    [list[SessionEvent], TurnPatch, SummaryUpdate | None, ContextEstimate | None],
    Awaitable[object],
]


@dataclass
class _Folded:
    """The outcome of folding a plan: a ``summary``, or why not (``rejection``, or
    ``stopped`` when the turn was asked to stop), and what every call used."""

    summary: str = ""
    rejection: Rejection | None = None
    stopped: bool = False
    usage: Usage = field(default_factory=Usage)
    #: The summary instructions' version (``prompts.SUMMARY_VERSION``, or ``configured``
    #: for ``planner.summary_instructions`` of the operator's own; decision 0294).
    prompt_version: str = ""


class Compactor:
    """Keeps a turn's model context: the system-side context, the estimate, and the
    compaction when the estimate is over the threshold."""

    def __init__(self, deps: TurnDependencies, state: TurnRun, commit: CommitCompaction) -> None:
        self._deps = deps
        self._state = state
        self._commit = commit
        self._context_read = False

    async def maybe_compact(self, prompt: Prompt) -> None:
        """Compact if the estimate is above ``compact_at_tokens`` and a compaction would
        move ``up_to`` forward; raises what ``commit`` raises."""
        state, settings = self._state, self._deps.settings
        if not self._context_read:
            await self._read_context()
        estimated = self._estimate(prompt)
        if state.compaction_failed or estimated <= settings.compact_at_tokens:
            return
        plan = plan_compaction(
            state.messages, human_sequence=state.handle.human_sequence, summary=state.summary
        )
        if plan is None:
            return
        folded = await self._fold(prompt, plan)
        if folded.usage != Usage():
            state.compaction_usage = state.compaction_usage + folded.usage
        if folded.stopped:
            return
        if folded.rejection is not None:
            await self._failed(folded.rejection)
            return
        kept = [m for m in state.messages if m.sequence > plan.up_to]
        # No usage is known for the compacted context: the next estimate is the fixed
        # prompt and the new system-side context at their size, plus what is kept.
        context = ContextEstimate(base_tokens=None, pending_tokens=messages_tokens(kept))
        await self._commit(
            [state.events.compacted(plan.up_to, estimated, folded.prompt_version)],
            TurnPatch(compaction_usage=state.compaction_usage),
            SummaryUpdate(folded.summary, plan.up_to),
            context,
        )
        state.summary = folded.summary
        state.summary_up_to = plan.up_to
        state.messages = kept
        state.context = context
        self._deps.observer.compacted()
        log.info(
            "compacted up_to=%d estimated_tokens=%d",
            plan.up_to,
            estimated,
            extra=state.handle.log_fields(),
        )
        await self._read_context()
        self._estimate(prompt)

    def request_tokens(self, prompt: Prompt) -> int:
        """The estimate of the next turn request (docs/spec/compaction.md), as the
        compaction check made it."""
        return self._estimate(prompt)

    def answered(self, usage: Usage | None) -> None:
        """An answer to the request last estimated came back with ``usage``: observe the
        estimate's error when it was made without reported usage."""
        estimated = self._state.request_estimate
        if usage is not None and usage.input_tokens > 0 and estimated is not None:
            self._deps.observer.context_estimated("turn", estimated, usage.input_tokens)
            raw = self._state.request_raw_estimate
            if raw is not None:
                self._deps.calibration.observe(raw, usage.input_tokens)

    # ------------------------------------------------------------------ the context

    async def _read_context(self) -> None:
        """Build the system-side context: with a summary, the pending changesets are read
        from the tracker (once per turn, and again after a compaction)."""
        state = self._state
        self._context_read = True
        pending = await pending_changesets(self._deps, state) if state.summary else None
        state.context_block = context_block(state.summary, pending)
        state.context_block_tokens = text_tokens(state.context_block)

    def _estimate(self, prompt: Prompt) -> int:
        """The estimate of the next request (docs/spec/compaction.md), remembered for ``answered``
        when no usage went into it; then it is calibrated to the model's count (decision
        0350)."""
        state = self._state
        fixed = prompt.fixed_tokens + state.context_block_tokens
        estimated = estimate_tokens(state.context, fixed_tokens=fixed)
        if state.context.base_tokens is not None:
            state.request_estimate = state.request_raw_estimate = None
            return estimated
        # Nothing reported went into it: counted in the model's tokens as learned from
        # its earlier answers (decision 0350).
        state.request_raw_estimate = estimated
        state.request_estimate = self._deps.calibration.scale(estimated)
        return state.request_estimate

    # ------------------------------------------------------------------ the compaction

    async def _failed(self, rejection: Rejection) -> None:
        """A failed compaction: logged without content, counted by reason, and no
        further try in this turn; the calls' usage is stored on the turn, nothing else."""
        state = self._state
        state.compaction_failed = True
        self._deps.observer.compaction_failed(rejection.reason)
        log.warning(
            "compaction failed (%s: %s); continuing uncompacted",
            rejection.reason,
            rejection.detail,
            extra=state.handle.log_fields(),
        )
        if state.compaction_usage != Usage():
            await self._commit([], TurnPatch(compaction_usage=state.compaction_usage), None, None)

    async def _fold(self, prompt: Prompt, plan: CompactionPlan) -> _Folded:
        """Fold ``plan.messages`` into its earlier summary, oldest first, in chunks that
        fit; every answer is checked before the next chunk builds on it."""
        deps, state = self._deps, self._state
        instructions = deps.settings.summary_instructions or prompts.summary_instructions()
        reserved = compaction_request_tokens(compaction_system_prompt(instructions, "", "")) + max(
            SUMMARY_ROOM_TOKENS, text_tokens(plan.previous_summary)
        )
        chunks = chunk_blocks(
            render_transcript(plan.messages),
            max_tokens=deps.settings.compaction_input_max_tokens,
            reserved_tokens=reserved,
        )
        folded = _Folded(summary=plan.previous_summary)
        folded.prompt_version = (
            prompts.SUMMARY_VERSION
            if instructions == prompts.summary_instructions()
            else "configured"
        )
        for chunk in chunks:
            system = compaction_system_prompt(instructions, folded.summary, chunk)
            estimate = compaction_request_tokens(system)
            cap = output_cap(deps, state, Purpose.COMPACTION, estimate)
            if isinstance(cap, Ending):
                # The turn's budget cannot pay for the compaction: proceed uncompacted; the
                # turn's own call is checked next (decision 0291).
                folded.rejection = Rejection("budget", cap.message)
                return folded
            request = model_request(
                deps,
                state,
                purpose=Purpose.COMPACTION,
                credential_ref=prompt.credential_ref,
                system=system,
                messages=[ModelMessage(Role.USER, COMPACTION_REQUEST)],
                tools=(),
                max_output_tokens=cap,
                input_estimate=estimate,
            )
            started = deps.clock.monotonic()
            streamed = await stream_answer(deps, state, request, relay=False)
            answer = streamed.answer
            if answer.usage is not None:
                folded.usage = folded.usage + answer.usage
                if answer.usage.input_tokens > 0:
                    deps.observer.context_estimated(
                        "compaction", compaction_request_tokens(system), answer.usage.input_tokens
                    )
            if streamed.stopped:
                folded.stopped = True
                return folded
            if streamed.failure is not None:
                folded.rejection = Rejection(
                    "model",
                    f"{streamed.failure.reason} after {deps.clock.monotonic() - started:.1f} s",
                )
                return folded
            replaced = text_tokens(folded.summary) + text_tokens(chunk)
            folded.rejection = check_summary(
                answer.text,
                answer.finish,
                replaced_tokens=replaced,
                framing=compaction_framing(instructions),
                source=chunk,
            )
            if folded.rejection is not None:
                return folded
            folded.summary = answer.text.strip()
        return folded
