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
    order (results are stored in completion order)."""
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
            calls: list[ToolCall] = []
            while index < len(messages) and messages[index].kind is MessageKind.TOOL_CALL:
                stored = messages[index]
                calls.append(ToolCall(stored.tool_call_id, stored.tool_name, stored.tool_arguments))
                index += 1
            out.append(ModelMessage(Role.ASSISTANT, text, tool_calls=tuple(calls)))
            for call in calls:
                result = results.get(call.call_id)
                if result is not None:
                    out.append(
                        ModelMessage(
                            Role.TOOL,
                            result.tool_result,
                            tool_call_id=call.call_id,
                            tool_name=call.name,
                            is_error=result.tool_error,
                        )
                    )
            # Results are emitted with their calls; skip them where they were stored.
            while index < len(messages) and messages[index].kind is MessageKind.TOOL_RESULT:
                index += 1
        else:
            index += 1
    return out
