"""The terminal client's output rules (ballet_chat/render.py; docs/spec/api-and-streams.md and
README.md): stitching text deltas by message id and offset, one line per tool call and result, the
turn's end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from ballet.planner.v1 import chat_pb2, resources_pb2
from google.rpc import error_details_pb2

from ballet_chat.client import (
    ChatClient,
    ChatOptions,
    Renderer,
    Sent,
    TextStitcher,
    describe_turn_end,
    from_a_question,
    short,
    summarize_result,
)


def test_stitcher_skips_what_was_shown_and_completes_from_the_full_text() -> None:
    stitcher = TextStitcher()
    assert stitcher.add("m1", 0, "Hello") == "Hello"
    assert stitcher.add("m1", 0, "Hello") == ""  # a repeat (e.g. after a reopen)
    assert stitcher.add("m1", 3, "lo, wo") == ", wo"  # overlaps what was shown
    assert stitcher.add("m2", 0, "Other") == "Other"  # another message keeps its own count
    assert stitcher.finish("m1", "Hello, world") == "rld"
    assert stitcher.finish("m2", "Other") == ""
    assert stitcher.finish("m3", "Never streamed") == "Never streamed"


def test_stitcher_after_a_gap_shows_the_whole_text_again() -> None:
    stitcher = TextStitcher()
    assert stitcher.add("m1", 0, "abc") == "abc"
    assert stitcher.add("m1", 6, "ghi") == "ghi"  # "def" was missed
    assert stitcher.finish("m1", "abcdefghi") == "\nabcdefghi"


@pytest.mark.parametrize(
    ("content", "is_error", "summary"),
    [
        (
            json.dumps({"items": [{"item_id": "A"}, {"item_id": "B"}], "total_size": 9}),
            False,
            "ok, 2 items (of 9)",
        ),
        (json.dumps({"items": [], "total_size": 0}), False, "ok, 0 items"),
        (
            json.dumps({"item": {"item_id": "PAN-4", "title": "Pantry inventory"}}),
            False,
            "ok, item PAN-4: Pantry inventory",
        ),
        (
            json.dumps({"entry": {"entry_id": "k1", "version": 2, "title": "Hosting"}}),
            False,
            "ok, entry k1 v2: Hosting",
        ),
        (
            json.dumps({"error": {"reason": "NOT_FOUND", "message": "no item X"}}),
            True,
            "error NOT_FOUND: no item X",
        ),
        (
            json.dumps({"truncated": True, "original_bytes": 40000}),
            False,
            "ok, 40000 bytes (cut for the model)",
        ),
        ("not json", True, "error: not json"),
    ],
)
def test_tool_results_are_summarized_in_a_few_words(
    content: str, is_error: bool, summary: str
) -> None:
    assert summarize_result(content, is_error) == summary


def test_short_makes_control_characters_spaces() -> None:
    # A piped line with a NUL named a session "field open.title of the request holds a
    # NUL" (the title is the first message, shortened).
    assert short("a\x00b \x1b[31mc\td\ne") == "a b [31mc d e"


def test_short_flattens_and_cuts() -> None:
    assert short("a\n  b") == "a b"
    assert short("x" * 200, 10) == "x" * 9 + "…"


def message(kind: int, **fields: object) -> resources_pb2.Message:
    return resources_pb2.Message(kind=kind, **fields)  # type: ignore[arg-type]


def test_renderer_shows_a_turn_as_a_human_reads_it() -> None:
    out = io.StringIO()
    renderer = Renderer(out)
    human = message(resources_pb2.MESSAGE_KIND_HUMAN, text="What is open?", human_id="alice")
    call = message(
        resources_pb2.MESSAGE_KIND_TOOL_CALL,
        tool_name="list_items",
        tool_arguments='{"kind":"epic"}',
    )
    result = message(
        resources_pb2.MESSAGE_KIND_TOOL_RESULT,
        tool_name="list_items",
        tool_result=json.dumps({"items": [{}], "total_size": 1}),
    )
    answer = message(resources_pb2.MESSAGE_KIND_ASSISTANT, message_id="m1", text="One epic.")
    responses = [
        chat_pb2.ChatResponse(tool_call_started=chat_pb2.ToolCallStarted(message=call)),
        chat_pb2.ChatResponse(tool_call_finished=chat_pb2.ToolCallFinished(message=result)),
        chat_pb2.ChatResponse(text_delta=chat_pb2.TextDelta(message_id="m1", text="One ")),
        chat_pb2.ChatResponse(text_delta=chat_pb2.TextDelta(message_id="m1", text="One ")),
        chat_pb2.ChatResponse(assistant_message=chat_pb2.AssistantMessage(message=answer)),
        chat_pb2.ChatResponse(
            turn_ended=chat_pb2.TurnEnded(
                reason=resources_pb2.TURN_END_REASON_COMPLETED,
                rounds=1,
                usage=resources_pb2.Usage(input_tokens=800, output_tokens=12),
            )
        ),
    ]
    # This client's own message is not echoed (the human just typed it).
    renderer.render(
        chat_pb2.ChatResponse(message_accepted=chat_pb2.MessageAccepted(message=human)), mine=True
    )
    for response in responses:
        renderer.render(response)
    assert out.getvalue() == (
        '  -> list_items {"kind":"epic"}\n'
        "  <- list_items: ok, 1 item\n"
        "One epic.\n"
        "[COMPLETED: 1 round, 812 tokens]\n"
    )


def test_renderer_echoes_messages_of_other_clients_and_marks_cut_text() -> None:
    out = io.StringIO()
    renderer = Renderer(out)
    other = message(resources_pb2.MESSAGE_KIND_HUMAN, text="hi", human_id="alice")
    renderer.render(chat_pb2.ChatResponse(message_accepted=chat_pb2.MessageAccepted(message=other)))
    renderer.render(
        chat_pb2.ChatResponse(text_delta=chat_pb2.TextDelta(message_id="m", text="Par"))
    )
    cut = message(resources_pb2.MESSAGE_KIND_ASSISTANT, message_id="m", text="Par", cut=True)
    renderer.render(chat_pb2.ChatResponse(assistant_message=chat_pb2.AssistantMessage(message=cut)))
    assert out.getvalue() == "alice: hi\nPar [cut]\n"


def test_a_failed_turn_names_its_reason() -> None:
    ended = chat_pb2.TurnEnded(
        reason=resources_pb2.TURN_END_REASON_FAILED,
        rounds=0,
        error_info=error_details_pb2.ErrorInfo(reason="MODEL_UNAVAILABLE"),
        error_message="the gateway is down",
    )
    assert describe_turn_end(ended) == (
        "[FAILED: no tool called; MODEL_UNAVAILABLE: the gateway is down]"
    )
    max_rounds = chat_pb2.TurnEnded(reason=resources_pb2.TURN_END_REASON_MAX_ROUNDS, rounds=2)
    assert describe_turn_end(max_rounds) == "[MAX_ROUNDS: 2 rounds; send a message to continue]"


def test_a_text_only_answer_does_not_read_as_nothing_happened() -> None:
    # "[COMPLETED: 0 rounds]" read as "nothing happened" to a new user (decision 0324).
    text_only = chat_pb2.TurnEnded(reason=resources_pb2.TURN_END_REASON_COMPLETED, rounds=0)
    assert describe_turn_end(text_only) == "[COMPLETED: answered without tools]"
    one = chat_pb2.TurnEnded(reason=resources_pb2.TURN_END_REASON_COMPLETED, rounds=1)
    assert describe_turn_end(one) == "[COMPLETED: 1 round]"


@pytest.mark.parametrize(
    ("content", "summary"),
    [
        (json.dumps({"items": [{"item_id": "A"}], "total_size": 1}), "ok, 1 item"),
        (json.dumps({"hits": [{"entry_id": "k"}]}), "ok, 1 hit"),
        (json.dumps({"entries": [{}]}), "ok, 1 entry"),
        (json.dumps({"skills": [{}, {}]}), "ok, 2 skills"),
    ],
)
def test_counts_take_the_right_plural(content: str, summary: str) -> None:
    assert summarize_result(content, False) == summary


def test_one_round_and_one_token_are_singular() -> None:
    ended = chat_pb2.TurnEnded(
        reason=resources_pb2.TURN_END_REASON_COMPLETED,
        rounds=1,
        usage=resources_pb2.Usage(input_tokens=1),
    )
    assert describe_turn_end(ended) == "[COMPLETED: 1 round, 1 token]"


def test_the_model_shown_is_the_one_the_turn_names() -> None:
    # The turn's model (turn_started, what the gateway was asked for), shown when it
    # first appears and when it changes; never a local setting.
    out = io.StringIO()
    renderer = Renderer(out)
    for model in ("qwen2.5:7b", "qwen2.5:7b", "gpt-4o-mini"):
        renderer.render(
            chat_pb2.ChatResponse(turn_started=chat_pb2.TurnStarted(model=model, max_rounds=3))
        )
    assert out.getvalue() == "  (model qwen2.5:7b)\n  (model gpt-4o-mini)\n"


@pytest.mark.parametrize(
    ("finish", "cut", "note"),
    [
        ("length", True, " [cut: the output limit]"),
        ("content_filter", True, " [cut: the provider's content filter]"),
        ("truncated", True, " [cut: the model's stream broke off]"),
        ("refusal", False, " [refused]"),
        ("", False, ""),
    ],
)
def test_an_answer_that_did_not_end_normally_says_why(finish: str, cut: bool, note: str) -> None:
    out = io.StringIO()
    answer = message(
        resources_pb2.MESSAGE_KIND_ASSISTANT, text="Half", cut=cut, finish_reason=finish
    )
    Renderer(out).render(
        chat_pb2.ChatResponse(assistant_message=chat_pb2.AssistantMessage(message=answer))
    )
    assert out.getvalue() == f"Half{note}\n"


def test_a_tool_call_shows_as_soon_as_its_name_is_known() -> None:
    out = io.StringIO()
    renderer = Renderer(out)
    progress = chat_pb2.ToolCallProgress(tool_call_id="c1", tool_name="get_item", index=0)
    renderer.render(chat_pb2.ChatResponse(tool_call_progress=progress))
    assert out.getvalue() == "  -> get_item …\n"
    call = message(
        resources_pb2.MESSAGE_KIND_TOOL_CALL,
        tool_call_id="c1",
        tool_name="get_item",
        tool_arguments='{"item_id":"PAN-4"}',
    )
    renderer.render(chat_pb2.ChatResponse(tool_call_started=chat_pb2.ToolCallStarted(message=call)))
    assert out.getvalue().endswith('  -> get_item {"item_id":"PAN-4"}\n')


def test_the_readme_shows_the_tool_call_lines_the_client_prints() -> None:
    # The README said "each tool call and its result on one line"; the client prints a
    # line when the model names the call, one with its arguments and one with its result.
    out = io.StringIO()
    renderer = Renderer(out)
    call = message(
        resources_pb2.MESSAGE_KIND_TOOL_CALL,
        tool_call_id="c1",
        tool_name="list_items",
        tool_arguments='{"kind":"epic","state":"open"}',  # what the demo model sends
    )
    result = message(
        resources_pb2.MESSAGE_KIND_TOOL_RESULT,
        tool_call_id="c1",
        tool_name="list_items",
        tool_result=json.dumps({"items": [{}, {}, {}], "total_size": 3}),
    )
    for response in (
        chat_pb2.ChatResponse(
            tool_call_progress=chat_pb2.ToolCallProgress(tool_call_id="c1", tool_name="list_items")
        ),
        chat_pb2.ChatResponse(tool_call_started=chat_pb2.ToolCallStarted(message=call)),
        chat_pb2.ChatResponse(tool_call_finished=chat_pb2.ToolCallFinished(message=result)),
    ):
        renderer.render(response)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert out.getvalue() in readme
    assert "its result on one\nline" not in readme


def test_a_queued_message_is_shown_queued_then_where_its_turn_starts() -> None:
    # Decision 0300: a message typed while an answer streams is queued; the client stays
    # busy until its turn ended, and shows the message again where it is answered.
    client = ChatClient(ChatOptions(address="x", token="t"), io.StringIO(), io.StringIO())
    sent = Sent(request_id="r-2", text="and the biggest?", on_busy=resources_pb2.ON_BUSY_ENQUEUE)
    client.pending[sent.request_id] = sent
    queued = chat_pb2.ChatResponse(
        session_id="s",
        turn_id="t-2",
        sequence=3,
        request_id="r-2",
        message_queued=chat_pb2.MessageQueued(
            text="and the biggest?", behind_turn_id="t-1", on_busy=resources_pb2.ON_BUSY_ENQUEUE
        ),
    )
    client.track(queued)
    assert client.queued == ["t-2"] and client.busy and sent.turn_id == "t-2"
    started = chat_pb2.ChatResponse(
        session_id="s",
        turn_id="t-2",
        sequence=6,
        message_accepted=chat_pb2.MessageAccepted(
            message=resources_pb2.Message(text="and the biggest?", human_id="alice")
        ),
    )
    client.track(started)
    assert client.queued == [] and client.running_turn == "t-2"
    client.track(
        chat_pb2.ChatResponse(
            session_id="s",
            turn_id="t-2",
            sequence=8,
            turn_ended=chat_pb2.TurnEnded(reason=resources_pb2.TURN_END_REASON_COMPLETED),
        )
    )
    assert not client.busy and sent.ok
    shown = client.out.getvalue()  # type: ignore[attr-defined]
    assert "(queued: and the biggest?; it runs when this answer ends)" in shown
    assert "alice: and the biggest?" in shown


def test_a_resumed_session_is_shown_from_a_question_not_mid_turn() -> None:
    def message(kind: resources_pb2.MessageKind.ValueType, text: str) -> resources_pb2.Message:
        return resources_pb2.Message(kind=kind, text=text)

    call = message(resources_pb2.MESSAGE_KIND_TOOL_CALL, "call")
    result = message(resources_pb2.MESSAGE_KIND_TOOL_RESULT, "result")
    answer = message(resources_pb2.MESSAGE_KIND_ASSISTANT, "answer")
    question = message(resources_pb2.MESSAGE_KIND_HUMAN, "question")
    # The window of the latest messages began inside a turn: that part is not shown.
    assert from_a_question([call, result, answer, question, answer]) == [question, answer]
    assert from_a_question([question, call, result, answer]) == [question, call, result, answer]
    # No question in the window (one long turn): all of it, rather than nothing.
    assert from_a_question([call, result, answer]) == [call, result, answer]


def test_the_served_model_is_shown_once_when_it_differs_from_the_configured_one() -> None:
    from ballet.planner.v1 import chat_pb2, resources_pb2

    from ballet_chat.render import Renderer

    out = io.StringIO()
    renderer = Renderer(out)
    renderer.model = "gpt-4o-mini"
    for _ in range(2):
        message = resources_pb2.Message(
            message_id="m1", text="Hello!", served_model="smollm2-135m-instruct-q8_0.gguf"
        )
        response = chat_pb2.ChatResponse(
            assistant_message=chat_pb2.AssistantMessage(message=message)
        )
        renderer.render(response)
    text = out.getvalue()
    assert text.count("(answered by smollm2-135m-instruct-q8_0.gguf)") == 1


def test_output_waits_while_a_line_is_typed_and_goes_on_marked() -> None:
    # Decision 0401: the line typed during an answer gets a line of its own; what comes
    # meanwhile is shown once it is entered, the answer going on after "… ".
    out = io.StringIO()
    renderer = Renderer(out)
    renderer.write("The items the tracker retur")
    renderer.hold(new_line=True)
    assert renderer.holding
    renderer.write("ned: PAN-1")
    renderer.line("  -> get_item …")
    assert out.getvalue() == "The items the tracker retur\n"
    out.write("> Tell me about PAN-4\n")  # the line the human typed, and its Enter
    renderer.at_line_start()
    renderer.release()
    renderer.write(" and PAN-2.")
    renderer.end_line()
    assert not renderer.holding
    assert out.getvalue() == (
        "The items the tracker retur\n"
        "> Tell me about PAN-4\n"
        "… ned: PAN-1\n"
        "  -> get_item …\n"
        " and PAN-2.\n"
    )


def test_a_line_typed_at_the_prompt_holds_output_on_the_prompts_line() -> None:
    out = io.StringIO()
    renderer = Renderer(out)
    renderer.write("> ")
    renderer.hold(new_line=False)  # the prompt's line is the typed line's
    renderer.line("bob: hello")
    assert out.getvalue() == "> "
    out.write("hi\n")  # what the human typed after the prompt, and Enter
    renderer.at_line_start()
    renderer.release()
    assert out.getvalue() == "> hi\nbob: hello\n"


def test_what_a_line_left_unentered_held_is_shown_on_a_line_of_its_own() -> None:
    out = io.StringIO()
    renderer = Renderer(out)
    renderer.hold(new_line=False)
    renderer.line("(cancelling the turn; Ctrl-C again quits)")
    out.write("> half a li")  # typed, never entered: the chat ends
    renderer.release(unentered=True)
    assert out.getvalue() == "> half a li\n(cancelling the turn; Ctrl-C again quits)\n"
    renderer.release(unentered=True)  # nothing held: nothing shown
    assert out.getvalue().endswith("quits)\n")


def test_the_chat_leaves_its_last_line_ended() -> None:
    # Ctrl-D as the first key of a line, or Ctrl-C at the prompt: what followed the chat
    # (scripts/try's "stopping dev") was printed on the prompt's line.
    out = io.StringIO()
    renderer = Renderer(out)
    renderer.write("> ")
    renderer.hold(new_line=False)  # a key of the line: Ctrl-D
    renderer.release(unentered=True)
    renderer.end_line()
    assert out.getvalue() == "> \n"
    renderer.write("> ")  # Ctrl-C at the prompt: nothing typed
    renderer.release(unentered=True)
    renderer.end_line()
    assert out.getvalue() == "> \n> \n"


def test_escape_sequences_in_what_the_planner_sends_are_shown_not_obeyed() -> None:
    # A model steered by a ticket's text answered with sequences that coloured the
    # terminal, retitled its window and overwrote the line (decision 0403).
    out = io.StringIO()
    renderer = Renderer(out)
    text = (
        "says \x1b[31mRED\x1b[0m \x1b]0;pwned\x07 title\rOVERWRITE\r\nfine\tnext \u202eabc \x9b1m"
    )
    renderer.render(chat_pb2.ChatResponse(text_delta=chat_pb2.TextDelta(message_id="m", text=text)))
    other = message(resources_pb2.MESSAGE_KIND_HUMAN, text="hi \x1b[2J", human_id="bob")
    renderer.render(chat_pb2.ChatResponse(message_accepted=chat_pb2.MessageAccepted(message=other)))
    shown = out.getvalue()
    assert shown == (
        "says ^[[31mRED^[[0m ^[]0;pwned^G title^MOVERWRITE\nfine\tnext <U+202E>abc <U+009B>1m\n"
        "bob: hi ^[[2J\n"
    )
    assert not any(c in shown for c in "\x1b\x07\r\x9b\u202e")


def test_a_note_in_the_middle_of_an_answer_marks_where_the_answer_goes_on() -> None:
    # A message typed while the answer streams is queued: its note cut a word in two,
    # and the rest of the word read as a new line of text.
    out = io.StringIO()
    renderer = Renderer(out)
    renderer.write("eleven twelve t")
    renderer.aside("  (queued: next; it runs when this answer ends)")
    renderer.write("hirteen fourteen")
    renderer.end_line()
    renderer.aside("  (a note between answers)")
    renderer.write("A new answer.")
    assert out.getvalue() == (
        "eleven twelve t\n"
        "  (queued: next; it runs when this answer ends)\n"
        "… hirteen fourteen\n"
        "  (a note between answers)\n"
        "A new answer."
    )
