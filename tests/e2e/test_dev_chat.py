"""``ballet-planner dev --config FILE --scenario FILE`` and ``ballet-planner chat``, one-shot
and interactive (README.md).

One ``dev`` process for the module, on the demo project, with a configuration file
(``max_rounds = 2``, ``compact_at_tokens = 20000``) and a scripted scenario written here.
The interactive client runs in a pseudo-terminal. Waits read the terminal or the
subprocess output with deadlines; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2, planner_service_pb2_grpc, resources_pb2

from tests.e2e.dev_support import DevProcess, Terminal, clean_env, command, run_cli
from tests.e2e.test_stop_signals import read_until

MAX_ROUNDS = 2
# Above what the character estimate of a short session gives (the system prompt and the
# tool declarations alone are about 4,000 tokens), below the usage "big" answers report.
COMPACT_AT_TOKENS = 20_000
REPORTED_INPUT_TOKENS = 50_000
SLOW_TEXT = (
    "This answer comes slowly, four characters at a time, so that a human can cancel it. " * 3
)

SCENARIO: dict[str, Any] = {
    "rules": [
        {
            "match": {"purpose": "compaction"},
            "reply": {
                "text": "Summary: the human asked for big answers and got them.",
                "usage": {"input_tokens": 300, "output_tokens": 12},
            },
        },
        {
            "comment": "A model that calls a tool on every answer (max_rounds stops it).",
            "match": {"purpose": "turn", "last_role": "tool", "tool_name": "list_changesets"},
            "reply": {"text": "Again.", "tool_calls": [{"name": "list_changesets"}]},
        },
        {
            "match": {"purpose": "turn", "last_role": "tool"},
            "reply": {"text": "Here is what I found: {{tool_result}}", "chunk_chars": 16},
        },
        {
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": r"(?i)\bloop\b"},
            "reply": {"text": "Looking.", "tool_calls": [{"name": "list_changesets"}]},
        },
        {
            "comment": "Reported usage above compact_at_tokens: the next turn compacts.",
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": r"(?i)\bbig\b"},
            "reply": {
                "text": "A big answer.",
                "usage": {"input_tokens": REPORTED_INPUT_TOKENS, "output_tokens": 40},
            },
        },
        {
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": r"(?i)\bslow\b"},
            "reply": {"text": SLOW_TEXT, "chunk_chars": 4, "delay_ms": 150},
        },
        {
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": r"(?i)\bfail\b"},
            "reply": {"error": {"code": "INVALID_ARGUMENT", "message": "scripted refusal"}},
        },
        {
            "match": {"purpose": "turn", "last_role": "human", "last_text_regex": r"(?i)\bepics\b"},
            "reply": {
                "text": "Let me list the open epics.",
                "tool_calls": [{"name": "list_items", "arguments": {"kind": "epic"}}],
            },
        },
        {"match": {"purpose": "turn"}, "reply": {"text": "A scripted answer.", "chunk_chars": 5}},
    ]
}

CONFIG = f"""
[planner]
max_rounds = {MAX_ROUNDS}
compact_at_tokens = {COMPACT_AT_TOKENS}

[server]
grace_s = 7
"""


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcess]:
    cwd = tmp_path_factory.mktemp("dev-chat")
    (cwd / "planner.toml").write_text(CONFIG)
    (cwd / "scenario.json").write_text(json.dumps(SCENARIO))
    started = DevProcess.start(
        ["--config", "planner.toml", "--scenario", "scenario.json", "--data-dir", "data"], cwd
    )
    try:
        yield started
    finally:
        code, out = started.stop()
        assert code == 0, f"dev exited with {code}:\n{out}\n{started.log()}"


def responses(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines()]


def events(replies: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [reply[kind] for reply in replies if kind in reply]


def test_config_max_rounds_ends_the_turn_after_exactly_that_many_rounds(dev: DevProcess) -> None:
    result = dev.chat("--json", "--message", "loop over the changesets")
    assert result.returncode == 0, result.stdout + result.stderr
    replies = responses(result.stdout)
    assert [s["maxRounds"] for s in events(replies, "turnStarted")] == [MAX_ROUNDS]
    started = events(replies, "toolCallStarted")
    assert [s["message"]["toolName"] for s in started] == ["list_changesets"] * MAX_ROUNDS
    assert len(events(replies, "toolCallFinished")) == MAX_ROUNDS
    (ended,) = events(replies, "turnEnded")
    assert (ended["reason"], ended["rounds"]) == ("TURN_END_REASON_MAX_ROUNDS", MAX_ROUNDS)


def test_config_compact_at_tokens_triggers_a_compaction(dev: DevProcess) -> None:
    first = dev.chat("--json", "--message", "give me a big answer")
    assert first.returncode == 0, first.stdout + first.stderr
    opened = responses(first.stdout)[0]["sessionOpened"]["session"]
    assert events(responses(first.stdout), "compacted") == []

    second = dev.chat("--json", "--session", opened["sessionId"], "--message", "another big one")
    assert second.returncode == 0, second.stdout + second.stderr
    replies = responses(second.stdout)
    (compacted,) = events(replies, "compacted")
    # The estimate starts from the usage the first answer reported
    # (docs/spec/compaction.md).
    assert int(compacted["estimatedTokens"]) > REPORTED_INPUT_TOKENS
    assert int(compacted["upTo"]) >= 1
    # Opened after the session's last event: nothing of the first turn is replayed.
    assert len(events(replies, "messageAccepted")) == 1

    shown = dev.chat("--session", opened["sessionId"], "--message", "and a third big one")
    assert shown.returncode == 0
    assert "(earlier conversation compacted" in shown.stdout


def test_chat_message_exits_nonzero_with_the_reason_said_once(dev: DevProcess) -> None:
    # The error goes to stderr, once; stdout keeps the transcript (a new user saw each
    # error twice, on both).
    failed = dev.chat("--message", "please fail")
    assert failed.returncode == 1
    assert failed.stderr.count("[FAILED") == 1
    assert "ballet-planner chat: the turn ended [FAILED: no tool called; " in failed.stderr
    assert "FAILED" not in failed.stdout

    refused = dev.chat("--message", "x" * 40_000)  # over planner.message_max_bytes
    assert refused.returncode == 1
    assert refused.stderr.count("MESSAGE_TOO_LONG") == 1
    assert "ballet-planner chat: message refused: INVALID_ARGUMENT MESSAGE_TOO_LONG" in (
        refused.stderr
    )
    assert "MESSAGE_TOO_LONG" not in refused.stdout
    # The session made for the refused message held nothing: it is gone, and no list
    # shows the refused text as a title.
    created = re.search(r"session (\S+) \(continue it", refused.stderr)
    assert created is not None, refused.stderr
    assert f"session {created.group(1)} deleted: its message was refused" in refused.stderr
    gone = dev.chat("--session", created.group(1), "--message", "hello")
    assert gone.returncode == 1 and "not found" in gone.stderr, gone.stderr


@pytest.mark.parametrize("raw", [b"caf\xe9", b"bad \xff utf8", b"\xff"])
def test_a_message_that_is_not_utf8_is_sent_with_replacements_and_the_chat_ends(
    dev: DevProcess, raw: bytes
) -> None:
    # Bytes that are not UTF-8 in argv (a new user's Latin-1 terminal): the client sends
    # them as U+FFFD and must still know the turn as its own, then exit.
    result = dev.chat("--json", "--message", os.fsdecode(raw), timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    replies = responses(result.stdout)
    session = replies[0]["sessionOpened"]["session"]["sessionId"]
    (ended,) = events(replies, "turnEnded")
    assert ended["reason"] == "TURN_END_REASON_COMPLETED"
    assert human_messages(dev, session) == [raw.decode("utf-8", "replace")]


def chat_from_a_pipe(dev: DevProcess, lines: bytes) -> subprocess.CompletedProcess[bytes]:
    """``ballet-planner chat`` as alice with ``lines`` on its stdin (a pipe), to its end."""
    return chat_from_a_pipe_args(dev, lines)


def piped_session(stdout: str) -> str:
    found = re.search(r"^new session (\S+) in project demo", stdout, re.MULTILINE)
    assert found, stdout
    return found.group(1)


def test_a_session_made_for_a_refused_message_is_replaced_by_the_next_message(
    dev: DevProcess,
) -> None:
    # A new user pasted a line over the limit, then asked something else: the session
    # made for the refused line, titled with it, held the next message. Now the next
    # message starts a session of its own and the empty one is deleted.
    result = chat_from_a_pipe(dev, b"x" * 40_000 + b"\nWhat are the open epics?\n")
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 1, stdout + stderr  # a line was refused
    sessions = re.findall(r"^new session (\S+) in project demo", stdout, re.MULTILINE)
    assert len(sessions) == 2 and sessions[0] != sessions[1], stdout
    assert f"session {sessions[0]} deleted: its message was refused" in stderr
    assert human_messages(dev, sessions[1]) == ["What are the open epics?"]


def test_piped_lines_are_sent_in_order_each_after_the_previous_turn(dev: DevProcess) -> None:
    # A new user piped messages: the first was never sent, the rest were refused "a turn
    # is running". Without a terminal, lines queue and the end of input waits.
    texts = ["first question", "What are the open epics?", "third, and last"]
    result = chat_from_a_pipe(dev, "".join(text + "\n" for text in texts).encode())
    stdout = result.stdout.decode()
    assert result.returncode == 0, stdout + result.stderr.decode()
    assert human_messages(dev, piped_session(stdout)) == texts
    assert stdout.count("[COMPLETED: ") == 3
    assert "a turn is running" not in stdout
    assert "> " + texts[1] in stdout  # the transcript shows what was sent
    assert result.stderr == b""


def test_piped_lines_go_on_after_a_failure_and_the_exit_code_says_so(dev: DevProcess) -> None:
    lines = b"hello\nplease fail\nbad \xff bytes\n/sessions\nthe end\n"
    result = chat_from_a_pipe(dev, lines)
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 1, stdout + stderr
    session = piped_session(stdout)
    assert human_messages(dev, session) == [
        "hello",
        "please fail",
        "bad \ufffd bytes",
        "the end",
    ]
    assert stderr.count("the turn ended [FAILED") == 1 and "FAILED" not in stdout
    assert stdout.count("[COMPLETED: ") == 3
    assert re.search(rf"\*\s+\d+  {session}", stdout)  # /sessions ran, in its place


def chat_process(dev: DevProcess, lines: str, *args: str) -> subprocess.Popen[str]:
    """``ballet-planner chat ARGS`` as alice, ``lines`` in a pipe on its stdin (already
    closed at their end), its stdout and stderr pipes."""
    read, write = os.pipe()
    os.write(write, lines.encode())
    os.close(write)
    try:
        return subprocess.Popen(
            [
                *command(),
                *("chat", "--address", dev.planner, "--user", "alice", "--data-dir", "data"),
                *args,
            ],
            cwd=dev.cwd,
            env=clean_env(),
            stdin=read,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(read)


def interrupt_when_streaming(chat: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C (SIGINT) once the slow answer streams; what the chat printed to its end."""
    printed = read_until(chat, SLOW_TEXT[:8])
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate(timeout=60)
    return printed + out, err


def test_ctrl_c_on_piped_lines_cancels_the_turn_and_sends_no_further_line(
    dev: DevProcess,
) -> None:
    # Decision 0321: as any Unix filter, a piped chat stops on Ctrl-C; it used to cancel
    # one turn and go on with the next line.
    chat = chat_process(dev, "tell me something slow\nthe next line\n")
    out, err = interrupt_when_streaming(chat)
    assert chat.returncode == 130, out + err
    assert "interrupted: the turn was cancelled; no further line was sent" in err, err
    assert "[CANCELLED" in out + err
    assert "the next line" not in out
    assert human_messages(dev, piped_session(out)) == ["tell me something slow"]
    assert "Traceback" not in err


def test_ctrl_c_on_message_says_the_turn_was_cancelled(dev: DevProcess) -> None:
    chat = chat_process(dev, "", "--message", "something slow, please")
    out, err = interrupt_when_streaming(chat)
    assert chat.returncode == 130, out + err
    said = [line for line in err.splitlines() if "interrupted: the turn" in line]
    assert len(said) == 1, err
    assert "interrupted: the turn was cancelled; see the session with --session " in said[0]
    assert "Traceback" not in err


def test_two_quick_ctrl_c_on_message_leave_at_once_and_still_cancel_the_turn(
    dev: DevProcess,
) -> None:
    # Found by a new-user trial: two SIGINTs in one pass of the chat's loop (`timeout`
    # sends one to the chat, then one to its group) left before the first one's cancel
    # was written, and the turn ran to its end. The second still leaves at once, once
    # the cancel is on its way.
    chat = chat_process(dev, "", "--message", "something slow, please")
    read_until(chat, SLOW_TEXT[:8])
    chat.send_signal(signal.SIGINT)
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate(timeout=60)
    assert chat.returncode == 130, out + err
    assert "Traceback" not in err
    found = re.search(r"session (\S+) \(continue it with --session", err)
    assert found, err
    assert turn_end_reasons(dev, found[1]) == [resources_pb2.TURN_END_REASON_CANCELLED]


def turn_end_reasons(dev: DevProcess, session_id: str) -> list[int]:
    """How the session's turns ended (GetTurn), waiting up to 30 s for each to end."""
    minted = run_cli(["token", "--user", "alice", "--data-dir", "data"], dev.cwd)
    assert minted.returncode == 0, minted.stderr
    metadata = (("authorization", f"Bearer {minted.stdout.strip()}"),)
    reasons = []
    with grpc.insecure_channel(dev.planner) as channel:
        stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
        listed = stub.ListMessages(
            planner_service_pb2.ListMessagesRequest(session_id=session_id),
            metadata=metadata,
            timeout=10,
        )
        turn_ids = dict.fromkeys(m.turn_id for m in listed.messages)
        for turn_id in turn_ids:
            deadline = time.monotonic() + 30
            while True:
                turn = stub.GetTurn(
                    planner_service_pb2.GetTurnRequest(session_id=session_id, turn_id=turn_id),
                    metadata=metadata,
                    timeout=10,
                ).turn
                if turn.state == resources_pb2.TURN_STATE_ENDED or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            reasons.append(turn.end_reason)
    return reasons


def test_a_resumed_session_says_earlier_messages_are_hidden_and_history_shows_them(
    dev: DevProcess,
) -> None:
    texts = [f"hello number {n}" for n in range(12)]
    first = chat_from_a_pipe(dev, "".join(text + "\n" for text in texts).encode())
    assert first.returncode == 0, first.stderr
    session = piped_session(first.stdout.decode())
    resumed = chat_from_a_pipe_args(dev, b"/history\n", "--session", session)
    out = resumed.stdout.decode()
    assert resumed.returncode == 0, out + resumed.stderr.decode()
    header, _, history = out.partition("all ")
    hidden = re.search(r"\(earlier messages are hidden; the latest (\d+) follow: /history", header)
    assert hidden is not None and 1 <= int(hidden[1]) <= 10, header
    # The shown messages start with a question, not in the middle of a turn.
    assert header.split(hidden[0], 1)[1].split("\n", 2)[1].startswith("alice: hello number ")
    assert "alice: hello number 0" not in header  # the oldest is hidden...
    assert "alice: hello number 0" in history  # ...and /history shows it
    assert all(f"alice: {text}" in history for text in texts)


def chat_from_a_pipe_args(
    dev: DevProcess, lines: bytes, *args: str
) -> subprocess.CompletedProcess[bytes]:
    """``ballet-planner chat ARGS`` as alice with ``lines`` on its stdin, to its end."""
    return subprocess.run(
        [
            *command(),
            *("chat", "--address", dev.planner, "--user", "alice", "--data-dir", "data"),
            *args,
        ],
        cwd=dev.cwd,
        env=clean_env(),
        input=lines,
        capture_output=True,
        timeout=60,
    )


def test_chat_names_what_to_do_for_an_address_it_cannot_use(tmp_path: Path) -> None:
    # A usage problem: exit 2, as for the other options.
    for address in ("garbage", "127.0.0.1:99999"):
        refused = run_cli(
            ["chat", "--address", address, "--token", "t", "--message", "hi"], tmp_path
        )
        assert refused.returncode == 2
        assert f"--address {address}: expected the planner's HOST:PORT" in refused.stderr
    url = run_cli(
        ["chat", "--address", "http://127.0.0.1:50051", "--token", "t", "--message", "hi"],
        tmp_path,
    )
    assert url.returncode == 2
    assert "--address http://127.0.0.1:50051: give HOST:PORT without a scheme" in url.stderr
    both = run_cli(["chat", "--user", "alice", "--token", "t", "--message", "hi"], tmp_path)
    assert both.returncode == 2
    assert "give --user NAME (a dev token minted here) or --token JWT, not both" in both.stderr
    remote = run_cli(
        ["chat", "--address", "example.com:50051", "--token", "t", "--message", "hi"], tmp_path
    )
    assert remote.returncode == 2
    assert "insecure" not in remote.stderr  # chat has no such option
    assert "--address example.com:50051: chat reaches a planner on this machine only" in (
        remote.stderr
    )
    assert "forward a local port to it" in remote.stderr


def test_chat_errors_say_what_to_do(dev: DevProcess, tmp_path: Path) -> None:
    unknown = dev.chat("--project", "nope", "--message", "hello")
    assert unknown.returncode == 1
    assert "project 'nope' not found" in unknown.stderr

    forged = dev.chat("--token", "not-a-jwt", "--message", "hello")
    assert forged.returncode == 1
    assert "the planner refused the token (UNAUTHENTICATED" in forged.stderr

    nowhere = run_cli(
        ["chat", "--address", "127.0.0.1:1", "--token", "t", "--message", "hello"], tmp_path
    )
    assert nowhere.returncode == 1
    assert "cannot reach the planner at 127.0.0.1:1" in nowhere.stderr

    # Another gRPC service on the port (the devstack's): said as such, not as gRPC's
    # "Method not found!".
    elsewhere = dev.chat("--address", dev.devstack, "--message", "hello")
    assert elsewhere.returncode == 1
    assert f"no planner answers at {dev.devstack}" in elsewhere.stderr, elsewhere.stderr

    no_secret = run_cli(
        ["chat", "--address", dev.planner, "--user", "alice", "--data-dir", "empty"], tmp_path
    )
    assert no_secret.returncode == 2
    assert f"no dev secret in {tmp_path / 'empty'}" in no_secret.stderr
    assert not (tmp_path / "empty").exists()


def test_interactive_chat_in_a_terminal(dev: DevProcess) -> None:
    terminal = Terminal(
        [
            *command(),
            "chat",
            "--address",
            dev.planner,
            "--user",
            "alice",
            "--data-dir",
            "data",
        ],
        dev.cwd,
        clean_env(),
    )
    try:
        # No session until the first message.
        terminal.expect(r"project demo on \S+: a new session starts with your first message")
        terminal.expect(r"> ")
        terminal.send("What are the open epics?")
        first = terminal.expect(r"new session (\S+) in project demo")
        terminal.expect(r'-> list_items \{"kind":"epic"\}')
        terminal.expect(r"<- list_items: ok, \d+ items")
        terminal.expect(r"Here is what I found: \{\"items\"")
        terminal.expect(r"\[COMPLETED: 1 round\]")
        terminal.expect(r"> ")

        terminal.send("/sessions")
        terminal.expect(r"sessions of demo \(newest first\):")
        terminal.expect(rf"\*\s+1  {first.group(1)}  \S+ \S+  What are the open epics\?")
        terminal.expect(r"> ")

        terminal.send("/new")
        terminal.expect(r"a new session starts with your first message")
        terminal.expect(r"> ")

        terminal.send("tell me something slow")
        second = terminal.expect(r"new session (\S+) in project demo")
        assert second.group(1) != first.group(1)
        terminal.expect(SLOW_TEXT[:8])  # the first deltas are on screen
        terminal.send("/cancel")
        terminal.expect(r"\(cancelling\)")
        ended = terminal.expect(r"\[cut\]\n\[CANCELLED: no tool called\]")
        assert SLOW_TEXT not in terminal.output[: ended.start()]  # it stopped mid-answer
        terminal.expect(r"> ")

        terminal.send("slow again, please")
        terminal.expect(SLOW_TEXT[:8])
        terminal.process.send_signal(signal.SIGINT)  # Ctrl-C during a turn cancels it
        terminal.expect(r"\(cancelling the turn; Ctrl-C again quits\)")
        terminal.expect(r"\[CANCELLED: no tool called\]")
        terminal.expect(r"> ")

        terminal.send(f"/open {first.group(1)}")
        terminal.expect(rf"session {first.group(1)} in project demo \(alice on ")
        # The session's latest messages (the client never echoes its own messages live).
        terminal.expect(r"alice: What are the open epics\?\n")
        terminal.expect(r"  -> list_items .*\n  <- list_items: ok, ")
        terminal.expect(r"> ")

        # Ctrl-D during an answer leaves as /quit does, saying the turn goes on.
        terminal.send("slow, one last time")
        terminal.expect(SLOW_TEXT[:8])
        terminal.keys("\x04")
        terminal.expect(r"the running turn goes on on the planner; /cancel first to stop it")
        assert terminal.wait() == 0
    finally:
        terminal.close()


def test_an_answer_waits_while_a_line_is_typed_over_it(dev: DevProcess) -> None:
    # Decision 0401: the line typed during an answer gets a line of its own and the answer
    # waits until it is entered, then goes on after "… "; a command's output starts a line.
    terminal = Terminal(
        [*command(), "chat", "--address", dev.planner, "--user", "alice", "--data-dir", "data"],
        dev.cwd,
        clean_env(),
    )
    try:
        terminal.expect(r"> ")
        terminal.send("tell me something slow")
        terminal.expect(SLOW_TEXT[:8])
        terminal.keys("/hist")
        terminal.expect(r"\n(\r\x1b\[K)?> /hist")
        # Four deltas' time (one every 150 ms): none of them is shown while typing.
        assert terminal.settle(0.7) == ""
        terminal.keys("ory\r")
        terminal.expect(r"ory\n… ")  # the typed line's end, then what the answer held
        terminal.expect(r"\nalice: tell me something slow\n")
        terminal.expect(r"\[COMPLETED")
        terminal.send("/quit")
        assert terminal.wait() == 0
    finally:
        terminal.close()


LEFT, UP, ENTER = "\x1b[D", "\x1b[A", "\r"


def test_the_terminal_edits_the_line_and_recalls_history(dev: DevProcess) -> None:
    # In a real pty, arrow keys edit the line (they never reach
    # the message) and the up arrow recalls the previous message.
    terminal = Terminal(
        [*command(), "chat", "--address", dev.planner, "--user", "alice", "--data-dir", "data"],
        dev.cwd,
        clean_env(TERM="xterm"),
    )
    try:
        terminal.expect(r"a new session starts with your first message")
        terminal.expect(r"> ")
        # "epis?", two left arrows (before "s"), "c", Enter: "epics?".
        terminal.keys("What are the open epis?")
        terminal.expect(r"What are the open epis\?")  # echoed as typed: readline shows it
        terminal.keys(LEFT + LEFT + "c" + ENTER)
        session = terminal.expect(r"new session (\S+) in project demo").group(1)
        terminal.expect(r'-> list_items \{"kind":"epic"\}')  # the scenario saw "epics"
        terminal.expect(r"\[COMPLETED: 1 round\]")
        terminal.expect(r"> ")
        terminal.keys(UP + ENTER)  # the previous message again
        terminal.expect(r'-> list_items \{"kind":"epic"\}')
        terminal.expect(r"\[COMPLETED: 1 round\]")
        terminal.expect(r"> ")
        terminal.send("/quit")
        assert terminal.wait() == 0
    finally:
        terminal.close()
    assert human_messages(dev, session) == ["What are the open epics?"] * 2


def human_messages(dev: DevProcess, session_id: str) -> list[str]:
    """The texts of the session's human messages, read with ListMessages."""
    minted = run_cli(["token", "--user", "alice", "--data-dir", "data"], dev.cwd)
    assert minted.returncode == 0, minted.stderr
    metadata = (("authorization", f"Bearer {minted.stdout.strip()}"),)
    with grpc.insecure_channel(dev.planner) as channel:
        listed = planner_service_pb2_grpc.PlannerServiceStub(channel).ListMessages(
            planner_service_pb2.ListMessagesRequest(session_id=session_id),
            metadata=metadata,
            timeout=10,
        )
    return [m.text for m in listed.messages if m.kind == resources_pb2.MESSAGE_KIND_HUMAN]


@pytest.mark.postgres
def test_dev_on_postgresql_migrates_and_serves(pg_url: str, tmp_path: Path) -> None:
    started = DevProcess.start(["--database-url", pg_url, "--data-dir", "data"], tmp_path)
    try:
        assert "(PostgreSQL)" in started.banner
        result = started.chat("--message", "What are the open epics?")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "-> list_items" in result.stdout
    finally:
        code, out = started.stop()
    assert code == 0, out
    assert not (tmp_path / "data" / "planner.db").exists()


def test_dev_refuses_bad_options(tmp_path: Path) -> None:
    missing = run_cli(["dev", "--tracker", "nowhere.jsonl"], tmp_path)
    assert (missing.returncode, "--tracker nowhere.jsonl: no such file" in missing.stderr) == (
        2,
        True,
    )
    project = run_cli(["dev", "--project", "beads"], tmp_path)
    assert project.returncode == 2 and "give --tracker too" in project.stderr
    (tmp_path / "bad.json").write_text('{"rules": [{"reply": {"txet": "typo"}}]}')
    scenario = run_cli(["dev", "--scenario", "bad.json"], tmp_path)
    assert scenario.returncode == 1 and "txet" in scenario.stderr
    openai = run_cli(["dev", "--provider", "openai"], tmp_path)
    assert openai.returncode == 1 and "BALLET_OPENAI_API_KEY" in openai.stderr
    port = run_cli(["dev", "--address", "127.0.0.1:99999"], tmp_path)
    assert port.returncode == 2  # named by the flag typed, then the key it sets
    assert "--address (server.address): expected host:port" in port.stderr, port.stderr
    # A folder that looks writable (root may write anywhere) but cannot be made: the
    # folder is named as the problem, not the dev secret that cannot be read there.
    unmade = run_cli(["dev", "--data-dir", "/proc/ballet-planner-test"], tmp_path)
    assert unmade.returncode == 1, unmade.stderr
    assert "data directory /proc/ballet-planner-test cannot be created" in unmade.stderr
    assert "dev secret" not in unmade.stderr
    assert os.listdir(tmp_path) == ["bad.json"]
