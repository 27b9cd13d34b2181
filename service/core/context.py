"""What the model sees: the system prompt and the conversation (seed: Instructions;
SPEC sections 4 to 6; decision 0012). Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

from service.core import prompts
from service.core.model import Message, MessageKind
from service.core.ports import ModelMessage, ProjectInfo, Role, SkillDocument, ToolCall


def build_system_prompt(project: ProjectInfo, skill: SkillDocument | None) -> str:
    """The system prompt (seed: Instructions): the built-in instructions, the project
    and organization, and the planner skill's SKILL.md when the project uses one."""
    parts = [
        prompts.instructions(),
        "## Project\n"
        f"- id: {project.project_id}\n"
        f"- name: {project.name}\n"
        f"- description: {project.description or '(none)'}",
        f"## Organization\n- id: {project.organization_id}\n- name: {project.organization_name}",
    ]
    if skill is not None:
        parts.append(
            f"## Planner skill: {skill.name} (version {skill.version})\n"
            "The project's own process rules for you:\n\n"
            f"{skill.content}"
        )
    return "\n\n".join(parts)


def to_model_messages(summary: str, messages: Sequence[Message]) -> list[ModelMessage]:
    """The conversation the model sees: the summary (when there is one), then the
    messages after it, each answer with its tool calls and then their results in call
    order (results are stored in completion order).

    Results are paired with calls by the planner's call id. The provider is spoken to
    with its own ids (``wire_ids``), answer by answer: a provider that reuses ids across
    answers gets each back within the answer that had it, never another call's result.
    """
    out: list[ModelMessage] = []
    if summary:
        out.append(ModelMessage(Role.USER, f"[Summary of the earlier conversation]\n{summary}"))
    results = {m.tool_call_id: m for m in messages if m.kind is MessageKind.TOOL_RESULT}
    index = 0
    while index < len(messages):
        message = messages[index]
        if message.kind is MessageKind.HUMAN:
            out.append(ModelMessage(Role.USER, message.text))
            index += 1
        elif message.kind in (MessageKind.ASSISTANT, MessageKind.TOOL_CALL):
            text = ""
            if message.kind is MessageKind.ASSISTANT:
                text = message.text
                index += 1
            stored: list[Message] = []
            while index < len(messages) and messages[index].kind is MessageKind.TOOL_CALL:
                stored.append(messages[index])
                index += 1
            wire = wire_ids(stored)
            calls = tuple(
                ToolCall(wire[m.tool_call_id], m.tool_name, m.tool_arguments) for m in stored
            )
            out.append(ModelMessage(Role.ASSISTANT, text, tool_calls=calls))
            for call in stored:
                result = results.get(call.tool_call_id)
                if result is not None:
                    out.append(
                        ModelMessage(
                            Role.TOOL,
                            result.tool_result,
                            tool_call_id=wire[call.tool_call_id],
                            tool_name=call.tool_name,
                            is_error=result.tool_error,
                        )
                    )
            # Results are emitted with their calls; skip them where they were stored.
            while index < len(messages) and messages[index].kind is MessageKind.TOOL_RESULT:
                index += 1
        else:
            index += 1
    return out


def wire_ids(calls: Sequence[Message]) -> dict[str, str]:
    """The id each call of one answer is sent to the provider with, by planner id: the
    provider's own id when it gave one that no other call of the answer shares (some
    providers require their ids back), else the planner's id (decision 0111)."""
    seen: dict[str, int] = {}
    for call in calls:
        if call.provider_call_id:
            seen[call.provider_call_id] = seen.get(call.provider_call_id, 0) + 1
    return {
        call.tool_call_id: (
            call.provider_call_id
            if call.provider_call_id and seen[call.provider_call_id] == 1
            else call.tool_call_id
        )
        for call in calls
    }
