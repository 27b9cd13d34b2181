"""Context compaction: the estimate and the policy (seed: Context compaction; SPEC 6).

Pure functions; the turn runner makes the model calls and the commit.

- The estimate is the usage reported for the latest answer plus about four UTF-8 bytes
  per token for what was added since; with no usage known, bytes / 4 over the system
  prompt, tool declarations, summary and messages. It is kept as a running total
  (``ContextEstimate``), so computing it costs O(1) per call.
- A compaction summarizes everything before the latest human message (the one that
  started the current turn), the earlier summary included; ``up_to`` is the sequence of
  the last message it covers, always below that human message. The current turn is never
  summarized, so a tool call and its result are never separated.
- Text larger than ``compaction_input_max_tokens`` is folded from the oldest end in
  chunks that fit, each call taking the summary so far and the next chunk.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from service.core.model import ContextEstimate, Message, MessageKind

BYTES_PER_TOKEN = 4


def tokens_for_bytes(size: int) -> int:
    """About four UTF-8 bytes per token, rounded up."""
    return (size + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN


def estimate_tokens(context: ContextEstimate, *, fixed_bytes: int) -> int:
    """The context the model would see, in tokens.

    ``fixed_bytes`` is the size of the system prompt, tool declarations and summary; it
    counts only when no usage is known (reported input tokens already include it).
    """
    if context.base_tokens is None:
        return tokens_for_bytes(fixed_bytes + context.pending_bytes)
    return context.base_tokens + tokens_for_bytes(context.pending_bytes)


@dataclass(frozen=True)
class CompactionPlan:
    """What one compaction covers: ``messages`` (after the old summary, before the
    current turn) folded into ``previous_summary``; ``up_to`` is the last one's sequence."""

    up_to: int
    previous_summary: str
    messages: tuple[Message, ...]


def plan_compaction(
    messages: Sequence[Message], *, human_sequence: int, summary: str
) -> CompactionPlan | None:
    """Plan a compaction of the context ``messages`` (those after the current summary).

    Returns None when it would not move ``up_to`` forward: nothing but the current turn
    is in the context (SPEC 6: then no call is made and ``max_rounds`` bounds the turn).
    """
    covered = tuple(m for m in messages if m.sequence < human_sequence)
    if not any(m.kind is not MessageKind.COMPACTION for m in covered):
        return None
    return CompactionPlan(
        up_to=max(m.sequence for m in covered), previous_summary=summary, messages=covered
    )


def render_transcript(messages: Sequence[Message]) -> list[str]:
    """Render messages as text blocks for the summarizer, each tool call followed by its
    result (results of parallel calls are stored in completion order)."""
    results = {m.tool_call_id: m for m in messages if m.kind is MessageKind.TOOL_RESULT}
    shown: set[str] = set()
    blocks: list[str] = []
    for message in messages:
        if message.kind is MessageKind.HUMAN:
            blocks.append(f"Human: {message.text}")
        elif message.kind is MessageKind.ASSISTANT:
            cut = " [cut off]" if message.cut else ""
            blocks.append(f"Assistant{cut}: {message.text}")
        elif message.kind is MessageKind.TOOL_CALL:
            blocks.append(
                f"Tool call {message.tool_name} ({message.tool_call_id}): {message.tool_arguments}"
            )
            result = results.get(message.tool_call_id)
            if result is not None:
                blocks.append(_render_result(result))
                shown.add(result.tool_call_id)
        elif message.kind is MessageKind.TOOL_RESULT and message.tool_call_id not in shown:
            blocks.append(_render_result(message))
    return blocks


def _render_result(message: Message) -> str:
    label = "error" if message.tool_error else "result"
    return f"Tool {label} {message.tool_name} ({message.tool_call_id}): {message.tool_result}"


def chunk_blocks(blocks: Sequence[str], *, max_tokens: int, reserved_tokens: int) -> list[str]:
    """Group blocks, oldest first, into chunks of at most ``max_tokens`` minus
    ``reserved_tokens`` (room for the summary so far); a block larger than a chunk is
    cut to fit, keeping its start."""
    budget = max(256, (max_tokens - reserved_tokens) * BYTES_PER_TOKEN)
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for block in blocks:
        data = block.encode()
        if len(data) > budget:
            block = data[: budget - 16].decode(errors="ignore") + " [...]"
            data = block.encode()
        if current and size + len(data) + 2 > budget:
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(block)
        size += len(data) + 2
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def compaction_prompt(previous_summary: str, chunk: str) -> str:
    """The user message of one compaction call."""
    earlier = previous_summary.strip() or "(none)"
    return (
        f"Earlier summary:\n{earlier}\n\n"
        f"Conversation to fold into the summary:\n{chunk}\n\n"
        "Write the updated summary."
    )


def looks_like_failure(summary: str) -> bool:
    """True for a summary the planner must not store: empty, or an error in disguise
    (a provider error text or an ``{"error": ...}`` object instead of a summary)."""
    text = summary.strip()
    if not text:
        return True
    lowered = text.lower()
    if lowered.startswith(("error:", "error -", "[error]")):
        return True
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and "error" in value
    return False
