"""The ``ballet.llm.v1.GenerateRequest`` of a ``ModelRequest``, as bytes.

The gateway client sends requests already serialized: the tool declarations are encoded
once per set of declarations, and each message once for as long as its object is reused
(the core keeps a session's earlier turns as the same objects,
``service.core.conversation``), so a turn's request costs what is new in it, not the
whole conversation again (decision 0115).
"""

from __future__ import annotations

import functools
import weakref

from ballet.llm.v1 import gateway_pb2

from service.core.model import copied
from service.core.ports import ModelMessage, ModelRequest, Purpose, Role, ToolDeclaration

_ROLES = {
    Role.USER: gateway_pb2.ROLE_USER,
    Role.ASSISTANT: gateway_pb2.ROLE_ASSISTANT,
    Role.TOOL: gateway_pb2.ROLE_TOOL,
}
_PURPOSES = {
    Purpose.TURN: gateway_pb2.PURPOSE_TURN,
    Purpose.COMPACTION: gateway_pb2.PURPOSE_COMPACTION,
}


def to_wire(request: ModelRequest, encoded: MessageEncodings | None = None) -> bytes:
    """``to_proto(request)`` serialized, with the tool declarations serialized once per
    set of declarations (they are the same on every call of a replica; concatenated
    protobuf messages merge, and a repeated field's entries append), and, with
    ``encoded``, each message encoded once for as long as its object is reused."""
    if encoded is None:
        head = to_proto(request, with_tools=False).SerializeToString()
        messages = b""
    else:
        head = to_proto(copied(request, messages=()), with_tools=False).SerializeToString()
        messages = b"".join([encoded.field(message) for message in request.messages])
    return head + messages + _tools_wire(tuple(request.tools))


class MessageEncodings:
    """Each ``ModelMessage``'s encoding as one entry of ``GenerateRequest.messages``,
    kept by object identity for as long as the object lives (the core keeps a session's
    earlier turns as the same objects: ``service.core.conversation``; a weak reference
    drops the encoding with its message, so this holds no more than the core does).
    Used from one event loop."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref[ModelMessage], bytes]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def field(self, message: ModelMessage) -> bytes:
        """The bytes of ``messages: [message]`` in a ``GenerateRequest``."""
        key = id(message)
        kept = self._kept.get(key)
        if kept is not None and kept[0]() is message:
            return kept[1]
        holder = gateway_pb2.GenerateRequest()
        _add_message(holder, message)
        encoded = holder.SerializeToString()
        # The callback runs when the message is freed, before its id can be reused.
        self._kept[key] = (weakref.ref(message, lambda _: self._kept.pop(key, None)), encoded)
        return encoded


@functools.lru_cache(maxsize=8)
def _tools_wire(tools: tuple[ToolDeclaration, ...]) -> bytes:
    return gateway_pb2.GenerateRequest(tools=[_tool(tool) for tool in tools]).SerializeToString()


def _tool(tool: ToolDeclaration) -> gateway_pb2.ToolDeclaration:
    return gateway_pb2.ToolDeclaration(
        name=tool.name,
        description=tool.description,
        parameters_json_schema=tool.parameters_json_schema,
    )


def to_proto(request: ModelRequest, *, with_tools: bool = True) -> gateway_pb2.GenerateRequest:
    """Convert a ``ModelRequest`` to ``ballet.llm.v1.GenerateRequest``."""
    proto = gateway_pb2.GenerateRequest(
        project_id=request.project_id,
        credential_ref=request.credential_ref,
        model=request.model,
        purpose=_PURPOSES[request.purpose],
        system_prompt=request.system_prompt,
        system_context=request.system_context,
        request_id=request.request_id,
        max_output_tokens=request.max_output_tokens,
    )
    for message in request.messages:
        _add_message(proto, message)
    if with_tools:
        proto.tools.extend(_tool(tool) for tool in request.tools)
    return proto


def _add_message(proto: gateway_pb2.GenerateRequest, message: ModelMessage) -> None:
    item = proto.messages.add(role=_ROLES[message.role])
    if message.role is Role.TOOL:
        item.tool_result.tool_call_id = message.tool_call_id
        item.tool_result.name = message.tool_name
        item.tool_result.content = message.text
        item.tool_result.is_error = message.is_error
    else:
        item.text = message.text
        for call in message.tool_calls:
            item.tool_calls.add(id=call.call_id, name=call.name, arguments=call.arguments)
