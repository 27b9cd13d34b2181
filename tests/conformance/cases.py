"""The named behaviours of the provider conformance suite, one ``Case`` each.

A case is what the OpenAI-compatible double answers (one ``Reply`` per request; the last
repeats) and what must come out of it:

- ``gateway``: the devstack gateway's first answer over gRPC, with the ``openai``
  provider pointed at the double (``Whole``: text, calls, finish, usage; ``Refused``: the
  status code and ErrorInfo reason);
- ``client``: what the planner's ``GrpcModelGateway`` yields to the core through that
  gateway, retries included (``Whole``, or ``Raised``: the ``ModelFailure`` reason, the text
  yielded before it, how many requests it made).

Deadlines are short where a case is about them (``FAST``), and the streams' pace is set
relative to them, so a case about 90 s of reasoning runs in a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from tests.conformance.openai_double import (
    Piece,
    Reply,
    call_fragment,
    calls_delta,
    chunk,
    error_body,
    event,
    sse,
    usage_chunk,
)

PLANTED_KEY = "sk-planted-Zq8dX3vL0pR7wT2yN5bC1mK9"
"""The API key the gateway is configured with, echoed back by the hostile 401 case."""

#: (first output, idle, total) seconds.
DEFAULT = (5.0, 5.0, 30.0)
FAST = (0.4, 0.4, 10.0)


@dataclass(frozen=True)
class Whole:
    """A whole answer: text, calls as (name, arguments), the finish reason (the port's
    ``FinishReason`` value), usage as (input, output) or None, and the calls' ids when a
    case is about them (None: any, distinct)."""

    text: str = ""
    calls: tuple[tuple[str, str], ...] = ()
    finish: str = "stop"
    usage: tuple[int, int] | None = (11, 7)
    ids: tuple[str, ...] | None = None
    #: Which calls are marked cut (an answer stopped at its output limit inside them,
    #: decision 0292); None: none is.
    cut: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class Refused:
    """The gateway failed the call with ``code`` and ErrorInfo ``reason``."""

    code: grpc.StatusCode
    reason: str


@dataclass(frozen=True)
class Raised:
    """The client raised ``ModelFailure(reason)`` after yielding ``text`` (and ``starts``
    tool-call starts), having sent ``attempts`` requests; ``message`` is in its message."""

    reason: str
    text: str = ""
    starts: tuple[str, ...] = ()
    attempts: int = 1
    message: str = ""


@dataclass(frozen=True)
class Case:
    name: str
    replies: list[Reply]
    gateway: Whole | Refused
    client: Whole | Raised
    deadlines: tuple[float, float, float] = DEFAULT
    #: The retry waits the client asked for (None: not checked).
    waits: tuple[float, ...] | None = None
    #: Strings that must appear nowhere the client can see.
    secrets: tuple[str, ...] = field(default=())


def ok(*chunks: dict[str, object] | str, delay_s: float = 0.0, end: str = "done") -> Reply:
    return Reply(pieces=sse(*chunks, delay_s=delay_s), end=end)  # type: ignore[arg-type]


HELLO = ok(
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Hello"}),
    chunk({"content": " world"}),
    chunk({}, "stop"),
    usage_chunk(),
    "[DONE]",
)

TWO_CALLS = (("list_items", '{"kind":"epic","state":"open"}'), ("list_runnable", "{}"))


def _slow_arguments() -> Reply:
    arguments = '{"kind":"epic","state":"open","epic":"demo-1"}'
    fragments = [chunk(calls_delta(call_fragment(0, "call_slow", "list_items", "")))]
    fragments += [
        chunk(calls_delta(call_fragment(0, arguments=arguments[i : i + 2])))
        for i in range(0, len(arguments), 2)
    ]
    # 24 fragments 0.1 s apart: 2.4 s of arguments, six times the first-output deadline.
    return ok(*fragments, chunk({}, "tool_calls"), usage_chunk(), "[DONE]", delay_s=0.1)


def _reasoning(field_name: str) -> Reply:
    thoughts = [chunk({"role": "assistant", field_name: f"step {i}. "}) for i in range(24)]
    return ok(
        *thoughts,
        chunk({"content": "Done thinking."}),
        chunk({}, "stop"),
        usage_chunk(),
        "[DONE]",
        delay_s=0.1,
    )


def _keepalive_only() -> Reply:
    # SSE comments are keep-alives, not model output: they must not hold the deadline.
    return Reply(pieces=[Piece(b": keep-alive\n\n", 0.1) for _ in range(40)], end="hang")


UNAUTHORIZED = Reply(
    status=401,
    headers={"content-type": "application/json"},
    pieces=error_body(
        f"Incorrect API key provided: {PLANTED_KEY}. Authorization: Bearer {PLANTED_KEY}",
        "invalid_request_error",
        "invalid_api_key",
    ),
)

CASES: list[Case] = [
    Case("text-stream", [HELLO], Whole("Hello world"), Whole("Hello world")),
    Case(
        "ids-reused-across-answers",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "call_0", "list_items", "{}"))),
                chunk({}, "tool_calls"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=(("list_items", "{}"),), finish="tool_calls", ids=("call_0",)),
        Whole(calls=(("list_items", "{}"),), finish="tool_calls", ids=("call_0",)),
    ),
    Case(
        "ids-reused-within-an-answer",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "call_0", "list_items", ""))),
                chunk(calls_delta(call_fragment(0, arguments=TWO_CALLS[0][1]))),
                chunk(calls_delta(call_fragment(1, "call_0", "list_runnable", ""))),
                chunk(calls_delta(call_fragment(1, arguments="{}"))),
                chunk({}, "tool_calls"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("call_0", "call_0")),
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("call_0", "call_0")),
    ),
    Case(
        "ids-reused-within-an-answer-same-index",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "0", "list_items", TWO_CALLS[0][1]))),
                chunk(calls_delta(call_fragment(0, "0", "list_runnable", "{}"))),
                chunk({}, "tool_calls"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("0", "0")),
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("0", "0")),
    ),
    Case(
        "ollama-parallel-calls-sharing-index-0",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "call_a1", "list_items", TWO_CALLS[0][1]))),
                chunk(calls_delta(call_fragment(0, "call_b2", "list_runnable", "{}"))),
                chunk({}, "tool_calls"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("call_a1", "call_b2")),
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("call_a1", "call_b2")),
    ),
    Case(
        "ollama-parallel-calls-without-index",
        [
            ok(
                chunk(
                    calls_delta(
                        call_fragment(None, "call_a1", "list_items", TWO_CALLS[0][1]),
                        call_fragment(None, "call_b2", "list_runnable", "{}"),
                    )
                ),
                chunk({}, "stop"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("call_a1", "call_b2")),
        Whole(calls=TWO_CALLS, finish="tool_calls", ids=("call_a1", "call_b2")),
    ),
    Case(
        "calls-without-ids",
        [
            ok(
                chunk(calls_delta(call_fragment(0, None, "list_items", TWO_CALLS[0][1]))),
                chunk(calls_delta(call_fragment(1, None, "list_runnable", "{}"))),
                chunk({}, "tool_calls"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=TWO_CALLS, finish="tool_calls"),
        Whole(calls=TWO_CALLS, finish="tool_calls"),
    ),
    Case(
        "slow-argument-streaming",
        [_slow_arguments()],
        Whole(
            calls=(("list_items", '{"kind":"epic","state":"open","epic":"demo-1"}'),),
            finish="tool_calls",
        ),
        Whole(
            calls=(("list_items", '{"kind":"epic","state":"open","epic":"demo-1"}'),),
            finish="tool_calls",
        ),
        deadlines=FAST,
    ),
    Case(
        "reasoning-content-before-the-answer",
        [_reasoning("reasoning_content")],
        Whole("Done thinking."),
        Whole("Done thinking."),
        deadlines=FAST,
    ),
    Case(
        "reasoning-before-the-answer",
        [_reasoning("reasoning")],
        Whole("Done thinking."),
        Whole("Done thinking."),
        deadlines=FAST,
    ),
    Case(
        "silence-beyond-the-first-output-deadline",
        [Reply(pieces=[], end="hang")],
        Whole(),  # not run at the gateway: it would hang until the provider's timeout
        Raised("MODEL_TIMEOUT", message="no output in 0.4 s"),
        deadlines=FAST,
    ),
    Case(
        "keep-alive-comments-are-not-output",
        [_keepalive_only()],
        Whole(),  # not run at the gateway, as above
        Raised("MODEL_TIMEOUT", message="no output in 0.4 s"),
        deadlines=FAST,
    ),
    Case(
        "truncated-after-text",
        [ok(chunk({"role": "assistant", "content": "Hello"}), chunk({"content": " wor"}))],
        Whole("Hello wor", finish="truncated", usage=None),
        Raised("MODEL_STREAM_TRUNCATED", text="Hello wor", message="cut off"),
    ),
    Case(
        "truncated-before-any-output",
        [ok(chunk({"role": "assistant"})), HELLO],
        Whole(finish="truncated", usage=None),
        Whole("Hello world"),
        waits=(0.5,),
    ),
    Case(
        "truncated-inside-arguments",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "call_x", "get_item", '{"item_id": "de'))),
            )
        ],
        Whole(finish="truncated", usage=None),
        Raised("MODEL_STREAM_TRUNCATED", starts=("get_item",)),
    ),
    Case(
        "truncated-mid-line",
        [
            Reply(
                pieces=[
                    Piece(event(chunk({"content": "Hi"}))),
                    Piece(event(chunk({}, "stop"))[:30]),
                ],
                end="eof",
            )
        ],
        Whole("Hi", finish="truncated", usage=None),
        Raised("MODEL_STREAM_TRUNCATED", text="Hi"),
    ),
    Case(
        "done-without-a-finish-reason",
        [ok(chunk({"content": "Hi"}), "[DONE]")],
        Whole("Hi", usage=None),
        Whole("Hi", usage=None),
    ),
    Case(
        "length",
        [ok(chunk({"content": "A long answ"}), chunk({}, "length"), usage_chunk(), "[DONE]")],
        Whole("A long answ", finish="length"),
        Whole("A long answ", finish="length"),
    ),
    Case(
        # The call the limit cut is passed on marked cut: the planner answers it with an
        # error result instead of failing the turn (decision 0292).
        "length-inside-arguments",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "call_x", "get_item", '{"item_id": "de'))),
                chunk({}, "length"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(calls=(("get_item", '{"item_id": "de'),), finish="length", cut=(True,)),
        Whole(calls=(("get_item", '{"item_id": "de'),), finish="length", cut=(True,)),
    ),
    Case(
        # llama.cpp with a small model: complete calls repeated until the limit, then a
        # cut one. The complete calls are passed on whole, the cut one marked.
        "length-after-complete-calls",
        [
            ok(
                chunk(calls_delta(call_fragment(0, "call_0", "list_items", '{"kind":"epic"}'))),
                chunk(calls_delta(call_fragment(1, "call_1", "list_items", '{"kind":"epic"}'))),
                chunk(calls_delta(call_fragment(2, "call_2", "list_items", '{"kind":'))),
                chunk({}, "length"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole(
            calls=(
                ("list_items", '{"kind":"epic"}'),
                ("list_items", '{"kind":"epic"}'),
                ("list_items", '{"kind":'),
            ),
            finish="length",
            cut=(False, False, True),
        ),
        Whole(
            calls=(
                ("list_items", '{"kind":"epic"}'),
                ("list_items", '{"kind":"epic"}'),
                ("list_items", '{"kind":'),
            ),
            finish="length",
            cut=(False, False, True),
        ),
    ),
    Case(
        "content-filter",
        [ok(chunk({"content": "Partial"}), chunk({}, "content_filter"), usage_chunk(), "[DONE]")],
        Whole("Partial", finish="content_filter"),
        Whole("Partial", finish="content_filter"),
    ),
    Case(
        "refusal",
        [
            ok(
                chunk({"role": "assistant", "refusal": "I can't help "}),
                chunk({"refusal": "with that."}),
                chunk({}, "stop"),
                usage_chunk(),
                "[DONE]",
            )
        ],
        Whole("I can't help with that.", finish="refusal"),
        Whole("I can't help with that.", finish="refusal"),
    ),
    Case(
        "error-event-before-any-output",
        [ok({"error": {"message": "server overloaded", "type": "server_error"}}), HELLO],
        Refused(grpc.StatusCode.UNAVAILABLE, "PROVIDER_STREAM_ERROR"),
        Whole("Hello world"),
        waits=(0.5,),
    ),
    Case(
        "error-event-after-text",
        [ok(chunk({"content": "Hel"}), {"error": {"message": "server overloaded"}})],
        Refused(grpc.StatusCode.UNAVAILABLE, "PROVIDER_STREAM_ERROR"),
        Raised("MODEL_UNAVAILABLE", text="Hel", message="broke off mid-answer"),
    ),
    Case(
        "reset-after-text",
        [ok(chunk({"content": "Hel"}), end="reset")],
        Refused(grpc.StatusCode.UNAVAILABLE, "PROVIDER_STREAM_BROKEN"),
        Raised("MODEL_UNAVAILABLE", text="Hel", message="broke off"),
    ),
    Case(
        "malformed-json-before-any-output",
        [ok('{"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hi"'), HELLO],
        Refused(grpc.StatusCode.UNAVAILABLE, "PROVIDER_STREAM_MALFORMED"),
        Whole("Hello world"),
        waits=(0.5,),
    ),
    Case(
        "http-401-echoing-the-key",
        [UNAUTHORIZED],
        Refused(grpc.StatusCode.UNAUTHENTICATED, "CREDENTIAL_EXPIRED"),
        Raised("CREDENTIAL_EXPIRED", message="HTTP 401"),
        secrets=(PLANTED_KEY, "Zq8dX3vL0pR7"),
    ),
    Case(
        "http-404",
        [
            Reply(
                status=404,
                headers={"content-type": "application/json"},
                pieces=error_body("The model does not exist", "invalid_request_error", None),
            )
        ],
        Refused(grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
        Raised("MODEL_ERROR", message="HTTP 404"),
    ),
    *[
        # A server that cannot serve the request's tools says so with a 400, each in its
        # own words (Ollama, vLLM, llama.cpp without --jinja): its own reason (0297).
        Case(
            f"http-400-tools-not-supported-{server}",
            [
                Reply(
                    status=400,
                    headers={"content-type": "application/json"},
                    pieces=error_body(text, "invalid_request_error", None),
                )
            ],
            Refused(grpc.StatusCode.INVALID_ARGUMENT, "TOOLS_NOT_SUPPORTED"),
            Raised("TOOLS_NOT_SUPPORTED", message="refused the planner's tools"),
        )
        for server, text in (
            ("ollama", "registry.ollama.ai/library/gemma:2b does not support tools"),
            (
                "vllm",
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
            ),
            ("llama-cpp", "tools param requires --jinja flag"),
        )
    ],
    Case(
        "http-429-with-retry-after",
        [
            Reply(
                status=429,
                headers={"content-type": "application/json", "retry-after": "2"},
                pieces=error_body("Rate limit reached", "requests", "rate_limit_exceeded"),
            ),
            HELLO,
        ],
        Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED"),
        Whole("Hello world"),
        waits=(2.0,),
    ),
    Case(
        "http-429-asking-too-long",
        [
            Reply(
                status=429,
                headers={"content-type": "application/json", "retry-after": "3600"},
                pieces=error_body("Rate limit reached", "requests", "rate_limit_exceeded"),
            )
        ],
        Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED"),
        Raised("RATE_LIMITED", message="not retried"),
        waits=(),
    ),
    Case(
        "http-500",
        [
            Reply(
                status=500,
                headers={"content-type": "application/json"},
                pieces=error_body("The server had an error", "server_error", None),
            )
        ],
        Refused(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
        Raised("MODEL_UNAVAILABLE", attempts=10, message="after 10 attempts"),
        waits=(0.5,) * 9,
    ),
    Case(
        # A local server restarting: refused for a few seconds, then back within the
        # retry window (decision 0297); every wait is counted, nothing else retries.
        "http-503-until-the-server-is-back",
        [
            *[
                Reply(
                    status=503,
                    headers={"content-type": "text/plain"},
                    pieces=[Piece(b"Loading model")],
                )
            ]
            * 5,
            HELLO,
        ],
        Refused(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
        Whole("Hello world"),
        waits=(0.5,) * 5,
    ),
    Case(
        "http-503-with-retry-after",
        [
            Reply(
                status=503,
                headers={"content-type": "text/plain", "retry-after": "1"},
                pieces=[Piece(b"upstream overloaded")],
            ),
            HELLO,
        ],
        Refused(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
        Whole("Hello world"),
        waits=(1.0,),
    ),
    Case(
        "no-usage-chunk",
        [ok(chunk({"content": "Hi"}), chunk({}, "stop"), "[DONE]")],
        Whole("Hi", usage=None),
        Whole("Hi", usage=None),
    ),
    Case(
        "usage-in-the-last-choice-chunk",
        [
            ok(
                chunk({"content": "Hi"}),
                chunk(
                    {},
                    "stop",
                    usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                ),
                "[DONE]",
            )
        ],
        Whole("Hi", usage=(5, 2)),
        Whole("Hi", usage=(5, 2)),
    ),
]

#: Cases whose gateway half would only wait for the provider's own timeout.
CLIENT_ONLY = {"silence-beyond-the-first-output-deadline", "keep-alive-comments-are-not-output"}
