"""The openai provider against a local replay of recorded Chat Completions streams.

The cassettes (`<repo>/../shared/data/llm-streams/openai-chat-*.yaml`, pydantic-ai
format: the request under `parsed_body`, the SSE body as a literal block) are replayed by
a stdlib HTTP server; every expected value is computed here from the recorded SSE body.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from ballet.llm.v1 import gateway_pb2

from devstack.gateway import (
    FinishChunk,
    FinishReason,
    ProviderChunk,
    ProviderError,
    TextChunk,
    Usage,
)
from devstack.gateway.openai_provider import ConfigError, OpenAIConfig, OpenAIProvider
from tests.devstack.gateway_support import StartGateway, assembled_calls, human, request
from tests.ports import refused_port

OPENAI_CASSETTES = ["openai-chat-parallel-tools.yaml", "openai-chat-tool-then-text.yaml"]

# --- the replay server --------------------------------------------------------------------


@dataclass
class Canned:
    """One HTTP answer: status, headers, and the body as pieces written one by one."""

    status: int = 200
    body: list[bytes] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    hold: threading.Event | None = None


class Replay:
    """A local Chat Completions endpoint answering from a queue and recording requests."""

    def __init__(self) -> None:
        self.answers: list[Canned] = []
        self.received: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.release = threading.Event()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                replay.received.append(json.loads(self.rfile.read(length)))
                replay.paths.append(self.path)
                canned = replay.answers.pop(0)
                if canned.hold is not None:
                    canned.hold.wait(10)
                self.send_response(canned.status)
                for name, value in canned.headers.items():
                    self.send_header(name, value)
                # Chunked, one HTTP chunk per piece, so the client sees a real stream.
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for piece in canned.body:
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def sse(self, body: str) -> None:
        """Queue a 200 SSE answer; each event is split in two pieces, to cut JSON lines."""
        pieces: list[bytes] = []
        for event in body.encode().split(b"\n\n"):
            if event.strip():
                half = len(event) // 2
                pieces += [event[:half], event[half:] + b"\n\n"]
        self.answers.append(Canned(body=pieces))

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def replay_server() -> Iterator[Replay]:
    server = Replay()
    yield server
    server.close()


@pytest.fixture
def replay(replay_server: Replay) -> Iterator[Replay]:
    """The module's replay server, emptied for this test; held answers end with it."""
    replay_server.answers.clear()
    replay_server.received.clear()
    replay_server.paths.clear()
    replay_server.release = threading.Event()
    yield replay_server
    replay_server.release.set()


def provider_for(replay: Replay, **kwargs: Any) -> OpenAIProvider:
    return OpenAIProvider(base_url=replay.base_url, api_key="test-key", **kwargs)


async def collect(
    provider: OpenAIProvider, req: gateway_pb2.GenerateRequest
) -> list[ProviderChunk]:
    return [chunk async for chunk in provider.generate(req)]


# --- cassettes ----------------------------------------------------------------------------


def load_interactions(llm_streams_dir: Path, name: str) -> list[dict[str, Any]]:
    data = yaml.safe_load((llm_streams_dir / name).read_text())
    interactions: list[dict[str, Any]] = data["interactions"]
    return interactions


def generate_request_from(body: dict[str, Any]) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest that should make the provider send this recorded body."""
    system: list[str] = []
    messages: list[gateway_pb2.Message] = []
    call_names: dict[str, str] = {}
    for m in body["messages"]:
        if m["role"] == "system":
            system.append(m["content"])
        elif m["role"] == "user":
            messages.append(gateway_pb2.Message(role=gateway_pb2.ROLE_USER, text=m["content"]))
        elif m["role"] == "assistant":
            calls = []
            for c in m.get("tool_calls") or []:
                call_names[c["id"]] = c["function"]["name"]
                calls.append(
                    gateway_pb2.ToolCall(
                        id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]
                    )
                )
            messages.append(
                gateway_pb2.Message(
                    role=gateway_pb2.ROLE_ASSISTANT, text=m.get("content") or "", tool_calls=calls
                )
            )
        else:
            assert m["role"] == "tool", m
            result = gateway_pb2.ToolResult(
                tool_call_id=m["tool_call_id"],
                name=call_names[m["tool_call_id"]],
                content=m["content"],
            )
            messages.append(gateway_pb2.Message(role=gateway_pb2.ROLE_TOOL, tool_result=result))
    tools = [
        gateway_pb2.ToolDeclaration(
            name=t["function"]["name"],
            description=t["function"].get("description", ""),
            parameters_json_schema=json.dumps(t["function"]["parameters"]),
        )
        for t in body.get("tools", [])
    ]
    return gateway_pb2.GenerateRequest(
        project_id="acme-demo",
        credential_ref="cred-1",
        model=body["model"],
        purpose=gateway_pb2.PURPOSE_TURN,
        system_prompt="\n\n".join(system),
        messages=messages,
        tools=tools,
    )


@dataclass
class Expected:
    text: str
    calls: list[tuple[str, str, str]]
    usage: Usage | None
    finish: str | None


def expected_from_sse(body: str) -> Expected:
    """What the recorded stream says, computed independently of the provider."""
    text = ""
    calls: dict[int, dict[str, str]] = {}
    usage: Usage | None = None
    finish: str | None = None
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if chunk.get("usage"):
            u = chunk["usage"]
            usage = Usage(u["prompt_tokens"], u["completion_tokens"])
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("content") or ""
            for fragment in delta.get("tool_calls") or []:
                call = calls.setdefault(fragment["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = call["id"] or fragment.get("id") or ""
                function = fragment.get("function") or {}
                call["name"] = call["name"] or function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    ordered = [(calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    return Expected(text, ordered, usage, finish)


def normalized_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages with "no content" spelled one way (absent, null and "" with tool calls)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m["role"] == "assistant" and m.get("tool_calls") and not m.get("content"):
            m.pop("content", None)
        out.append(m)
    return out


def tool_views(tools: list[dict[str, Any]]) -> list[tuple[str, str, str, Any]]:
    return [
        (
            t["type"],
            t["function"]["name"],
            t["function"].get("description", ""),
            t["function"]["parameters"],
        )
        for t in tools
    ]


def cassette_cases(llm_streams_dir: Path) -> list[tuple[str, int, dict[str, Any]]]:
    return [
        (name, i, interaction)
        for name in OPENAI_CASSETTES
        for i, interaction in enumerate(load_interactions(llm_streams_dir, name))
    ]


async def test_cassette_streams_are_reproduced_exactly(
    llm_streams_dir: Path, replay: Replay
) -> None:
    cases = cassette_cases(llm_streams_dir)
    assert len(cases) == 5
    provider = provider_for(replay)
    saw_parallel = False
    try:
        for name, index, interaction in cases:
            recorded = interaction["request"]["parsed_body"]
            sse_body = interaction["response"]["body"]["string"]
            expected = expected_from_sse(sse_body)
            saw_parallel = saw_parallel or len(expected.calls) > 1
            replay.sse(sse_body)

            chunks = await collect(provider, generate_request_from(recorded))

            where = f"{name} interaction {index}"
            texts = [c.text for c in chunks if isinstance(c, TextChunk)]
            calls = assembled_calls(chunks)
            assert "".join(texts) == expected.text, where
            assert calls == expected.calls, where
            assert all(json.loads(arguments) is not None for _, _, arguments in calls), where
            finish = chunks[-1]
            assert isinstance(finish, FinishChunk), where
            assert finish.usage == expected.usage, where
            assert expected.finish is not None
            assert finish.reason == FinishReason(expected.finish), where
            assert [c for c in chunks if isinstance(c, FinishChunk)] == [chunks[-1]], where

            sent = replay.received[-1]
            assert replay.paths[-1] == "/v1/chat/completions"
            assert sent["model"] == recorded["model"], where
            assert sent["stream"] is True
            assert sent["stream_options"] == recorded["stream_options"] == {"include_usage": True}
            assert normalized_messages(sent["messages"]) == normalized_messages(
                recorded["messages"]
            ), where
            assert tool_views(sent["tools"]) == tool_views(recorded["tools"]), where
            # Not part of the gateway contract: the model chooses whether to call tools.
            assert "tool_choice" not in sent
            assert "max_tokens" not in sent and "max_completion_tokens" not in sent
    finally:
        await provider.aclose()
    assert saw_parallel, "the parallel-tools cassette should hold two calls in one answer"


async def test_a_cassette_through_the_grpc_gateway(
    llm_streams_dir: Path, replay: Replay, start_gateway: StartGateway
) -> None:
    interactions = load_interactions(llm_streams_dir, "openai-chat-tool-then-text.yaml")
    provider = provider_for(replay)
    gw = await start_gateway(provider)
    try:
        for interaction in interactions:
            sse_body = interaction["response"]["body"]["string"]
            expected = expected_from_sse(sse_body)
            replay.sse(sse_body)
            req = generate_request_from(interaction["request"]["parsed_body"])
            answer = await gw.generate(req)
            assert answer.text == expected.text
            assert [(c.id, c.name, c.arguments) for c in answer.tool_calls] == expected.calls
            assert expected.usage is not None
            assert answer.finish.usage.input_tokens == expected.usage.input_tokens
            assert answer.finish.usage.output_tokens == expected.usage.output_tokens
            assert expected.finish is not None
            assert answer.finish.reason == gateway_pb2.FinishReason.Value(
                f"FINISH_REASON_{expected.finish.upper()}"
            )
        calls, input_tokens, output_tokens = gw.servicer.ledger.totals("acme-demo")
        assert calls == len(interactions)
        usages = [expected_from_sse(i["response"]["body"]["string"]).usage for i in interactions]
        assert input_tokens == sum(u.input_tokens for u in usages if u)
        assert output_tokens == sum(u.output_tokens for u in usages if u)
    finally:
        await provider.aclose()


# --- conversion details on synthetic streams ----------------------------------------------


def sse_of(*chunks: dict[str, Any]) -> str:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    lines = [f"data: {json.dumps({**base, **c})}\n\n" for c in chunks]
    return "".join(lines) + "data: [DONE]\n\n"


def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_request_fields_system_prompt_limit_and_default_model(replay: Replay) -> None:
    provider = provider_for(
        replay, model="default-model", token_limit_param="max_completion_tokens"
    )
    replay.sse(sse_of(choice({"content": "ok"}, "stop")))
    req = request(human("hi"), purpose="compaction")
    req.max_output_tokens = 256
    chunks = await collect(provider, req)
    await provider.aclose()
    assert chunks == [TextChunk("ok"), FinishChunk(FinishReason.STOP, None, "stop", "m")]
    sent = replay.received[0]
    assert sent["model"] == "default-model"
    assert sent["messages"] == [
        {"role": "system", "content": "You are the planner."},
        {"role": "user", "content": "hi"},
    ]
    assert sent["max_completion_tokens"] == 256
    assert "max_tokens" not in sent
    # Compaction offers no tools, and the API refuses an empty list.
    assert "tools" not in sent


@pytest.mark.parametrize("mode", ["message", "merged"])
async def test_system_context_follows_the_system_prompt(replay: Replay, mode: str) -> None:
    # Decision 0296: the project block goes after the instructions (and the tools, as
    # chat templates render them), its own system message unless the template needs one.
    provider = provider_for(replay, model="m", system_context=mode)
    replay.sse(sse_of(choice({"content": "ok"}, "stop")))
    req = request(human("hi"))
    req.system_context = "## Project\n- id: demo"
    await collect(provider, req)
    await provider.aclose()
    sent = replay.received[0]["messages"]
    if mode == "message":
        assert sent[:2] == [
            {"role": "system", "content": "You are the planner."},
            {"role": "system", "content": "## Project\n- id: demo"},
        ]
    else:
        assert sent[0] == {
            "role": "system",
            "content": "You are the planner.\n\n## Project\n- id: demo",
        }
    assert sent[-1] == {"role": "user", "content": "hi"}


async def test_max_tokens_and_request_model_override(replay: Replay) -> None:
    provider = provider_for(replay, model="default-model")
    replay.sse(sse_of(choice({"content": "ok"}, "stop")))
    req = request(human("hi"), model="gpt-x")
    req.max_output_tokens = 100
    await collect(provider, req)
    await provider.aclose()
    assert replay.received[0]["model"] == "gpt-x"
    assert replay.received[0]["max_tokens"] == 100


async def test_tool_calls_are_assembled_by_index_in_the_order_they_start(replay: Replay) -> None:
    def fragment(index: int, **fields: Any) -> dict[str, Any]:
        return choice({"tool_calls": [{"index": index, **fields}]})

    replay.sse(
        sse_of(
            choice({"role": "assistant", "content": "Checking. "}),
            fragment(
                3, id="call_b", type="function", function={"name": "get_item", "arguments": ""}
            ),
            fragment(2, id="call_a", type="function", function={"name": "list_items"}),
            fragment(3, function={"arguments": '{"ite'}),
            fragment(2, function={"arguments": '{"kind":"ep'}),
            fragment(3, function={"arguments": 'm_id":"demo-1"}'}),
            fragment(2, function={"arguments": 'ic"}'}),
            fragment(5, type="function", function={"name": "list_runnable", "arguments": "{}"}),
            # Some local servers finish tool calls with "stop".
            choice({}, "stop"),
            {
                "choices": [],
                "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
            },
        )
    )
    provider = provider_for(replay, model="m")
    chunks = await collect(provider, request(human("hi")))
    await provider.aclose()
    assert chunks[0] == TextChunk("Checking. ")
    calls = assembled_calls(chunks)
    assert calls[:2] == [
        ("call_b", "get_item", '{"item_id":"demo-1"}'),
        ("call_a", "list_items", '{"kind":"epic"}'),
    ]
    # No id from the server: one is made up, so results can still be paired.
    assert calls[2][1] == "list_runnable" and calls[2][0].startswith("call_")
    assert chunks[-1] == FinishChunk(FinishReason.TOOL_CALLS, Usage(10, 4), "stop", "m")


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("length", FinishReason.LENGTH), ("content_filter", FinishReason.CONTENT_FILTER)],
)
async def test_finish_reasons(replay: Replay, reason: str, expected: FinishReason) -> None:
    replay.sse(sse_of(choice({"content": "partial"}, reason)))
    provider = provider_for(replay, model="m")
    chunks = await collect(provider, request(human("hi")))
    await provider.aclose()
    assert chunks[-1] == FinishChunk(expected, None, reason, "m")


async def test_no_model_anywhere_is_invalid_argument(replay: Replay) -> None:
    provider = provider_for(replay)
    with pytest.raises(ProviderError) as caught:
        await collect(provider, request(human("hi")))
    await provider.aclose()
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "MODEL_REQUIRED"
    assert replay.received == []


async def test_a_tool_schema_that_is_not_json_is_invalid_argument(replay: Replay) -> None:
    provider = provider_for(replay, model="m")
    req = request(human("hi"))
    req.tools.append(gateway_pb2.ToolDeclaration(name="broken", parameters_json_schema="{"))
    with pytest.raises(ProviderError) as caught:
        await collect(provider, req)
    await provider.aclose()
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "broken" in caught.value.message


# --- errors -------------------------------------------------------------------------------


def error_body(code: str | None, type_: str = "error") -> list[bytes]:
    return [json.dumps({"error": {"message": "refused", "type": type_, "code": code}}).encode()]


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("status", "body", "headers", "code", "reason", "retry_after_s"),
    [
        (
            429,
            error_body("rate_limit_exceeded", "requests"),
            {**JSON, "retry-after-ms": "1500"},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RATE_LIMITED",
            1.5,
        ),
        (
            429,
            error_body(None),
            {**JSON, "retry-after": "2"},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RATE_LIMITED",
            2.0,
        ),
        (
            429,
            error_body("insufficient_quota", "insufficient_quota"),
            JSON,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUOTA_EXCEEDED",
            None,
        ),
        (
            401,
            error_body("invalid_api_key"),
            JSON,
            grpc.StatusCode.UNAUTHENTICATED,
            "CREDENTIAL_EXPIRED",
            None,
        ),
        (403, error_body(None), JSON, grpc.StatusCode.PERMISSION_DENIED, None, None),
        (404, error_body("model_not_found"), JSON, grpc.StatusCode.NOT_FOUND, None, None),
        (400, error_body("invalid_value"), JSON, grpc.StatusCode.INVALID_ARGUMENT, None, None),
        (
            400,
            error_body("context_length_exceeded"),
            JSON,
            grpc.StatusCode.INVALID_ARGUMENT,
            "CONTEXT_LENGTH_EXCEEDED",
            None,
        ),
        (500, error_body(None), JSON, grpc.StatusCode.UNAVAILABLE, None, None),
        (
            503,
            [b"upstream overloaded"],
            {"content-type": "text/plain"},
            grpc.StatusCode.UNAVAILABLE,
            None,
            None,
        ),
    ],
)
async def test_http_errors_are_translated(
    replay: Replay,
    status: int,
    body: list[bytes],
    headers: dict[str, str],
    code: grpc.StatusCode,
    reason: str | None,
    retry_after_s: float | None,
) -> None:
    replay.answers.append(Canned(status=status, body=body, headers=headers))
    provider = provider_for(replay, model="m")
    with pytest.raises(ProviderError) as caught:
        await collect(provider, request(human("hi")))
    await provider.aclose()
    assert caught.value.code == code
    assert caught.value.reason == reason
    assert caught.value.retry_after_s == retry_after_s
    assert len(replay.received) == 1, "the SDK must not retry: the planner does"


async def test_an_error_event_mid_stream_is_unavailable_after_the_deltas(replay: Replay) -> None:
    without_done = sse_of(choice({"content": "Hel"})).removesuffix("data: [DONE]\n\n")
    replay.sse(without_done + 'data: {"error": {"message": "server overloaded"}}\n\n')
    provider = provider_for(replay, model="m")
    seen: list[ProviderChunk] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in provider.generate(request(human("hi"))):
            seen.append(chunk)
    await provider.aclose()
    assert seen == [TextChunk("Hel")]
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "server overloaded" in caught.value.message


async def test_connection_refused_is_unavailable() -> None:
    with refused_port() as port:
        provider = OpenAIProvider(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", model="m")
        with pytest.raises(ProviderError) as caught:
            await collect(provider, request(human("hi")))
        await provider.aclose()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


async def test_a_timeout_is_deadline_exceeded(replay: Replay) -> None:
    replay.answers.append(Canned(hold=replay.release))
    provider = provider_for(replay, model="m", timeout_s=0.2)
    with pytest.raises(ProviderError) as caught:
        await collect(provider, request(human("hi")))
    await provider.aclose()
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_provider_errors_reach_the_client_with_error_info(
    replay: Replay, start_gateway: StartGateway
) -> None:
    replay.answers.append(
        Canned(
            status=429, body=error_body("rate_limit_exceeded"), headers={**JSON, "retry-after": "3"}
        )
    )
    provider = provider_for(replay, model="m")
    gw = await start_gateway(provider)
    failure = await gw.fail(request(human("hi")))
    await provider.aclose()
    assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failure.error_info.reason == "RATE_LIMITED"
    assert failure.error_info.domain == "llm.ballet"
    assert failure.retry_info is not None
    assert failure.retry_info.retry_delay.seconds == 3


# --- settings -----------------------------------------------------------------------------


def test_config_from_env() -> None:
    config = OpenAIConfig.from_env(
        {
            "BALLET_OPENAI_BASE_URL": "http://127.0.0.1:11434/v1",
            "BALLET_OPENAI_MODEL": "llama3.2",
            "BALLET_OPENAI_TOKEN_LIMIT_PARAM": "max_completion_tokens",
            "BALLET_OPENAI_TIMEOUT_S": "30",
        }
    )
    assert config.base_url == "http://127.0.0.1:11434/v1"
    assert config.model == "llama3.2"
    assert config.api_key  # a placeholder: local servers ignore it, the SDK wants one
    assert config.token_limit_param == "max_completion_tokens"
    assert config.timeout_s == 30.0
    assert config.system_context == "message"
    merged = OpenAIConfig.from_env(
        {"OPENAI_API_KEY": "k", "BALLET_OPENAI_SYSTEM_CONTEXT": "merged"}
    )
    assert merged.system_context == "merged"
    fallback = OpenAIConfig.from_env({"OPENAI_API_KEY": "sk-test"})
    assert fallback.base_url == "https://api.openai.com/v1"
    assert fallback.api_key == "sk-test"
    assert "sk-test" not in repr(fallback)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "BALLET_OPENAI_API_KEY"),
        (
            {"OPENAI_API_KEY": "k", "BALLET_OPENAI_TOKEN_LIMIT_PARAM": "max"},
            "BALLET_OPENAI_TOKEN_LIMIT_PARAM",
        ),
        ({"OPENAI_API_KEY": "k", "BALLET_OPENAI_TIMEOUT_S": "soon"}, "BALLET_OPENAI_TIMEOUT_S"),
        (
            {"OPENAI_API_KEY": "k", "BALLET_OPENAI_SYSTEM_CONTEXT": "first"},
            "BALLET_OPENAI_SYSTEM_CONTEXT",
        ),
    ],
)
def test_config_errors_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OpenAIConfig.from_env(env)
