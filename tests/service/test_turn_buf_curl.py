"""A Chat driven by a client we did not write: ``buf curl``.

The devstack imports the real beads export (``../shared/data/tracker``) as project
``beads``; the scripted model reads a scenario file: it lists the epics, reads the first
one it got back with ``get_item``, and answers in several deltas.

How ``buf curl`` does a bidirectional stream (buf 1.75): with ``--data @-`` it reads JSON
documents from stdin and sends each one as soon as it is complete, while it prints every
response message as soon as it arrives, as indented protobuf JSON (camelCase field names,
enums by name, int64 as strings); EOF on stdin half-closes the stream, and it exits 0
when the call ends OK. It needs HTTP/2 (``--http2-prior-knowledge`` for plaintext) and
gets the schema by server reflection, which the planner serves. So the test talks to it
like a person at a terminal: it writes ``open``, waits for ``sessionOpened``, writes
``sendMessage``, waits for ``turnEnded``, then closes stdin; the planner keeps a
half-closed stream open until the turn it started has ended (docs/spec/api-and-streams.md), so
closing stdin earlier would work too.

``buf`` is found on PATH or where CI installs it (``.venv/buf/node_modules/.bin/buf``);
without it the test skips, except with ``CI=true``, where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from ballet.planner.v1 import resources_pb2
from google.protobuf import json_format

from devstack.gateway import Scenario
from tests.service.turn_support import WAIT_S, Rig, start_rig, stop_rig

REPO = Path(__file__).resolve().parents[2]
CI_BUF = REPO / ".venv" / "buf" / "node_modules" / ".bin" / "buf"
CHAT = "ballet.planner.v1.PlannerService/Chat"

#: The scenario file of the test (devstack/gateway/scripted.py): epics, then the first epic, then an
#: answer that quotes what get_item returned, streamed 12 characters at a time.
SCENARIO = {
    "comment": "buf curl drives Chat on the beads project",
    "rules": [
        {
            "match": {"purpose": "turn", "last_role": "human"},
            "reply": {
                "text": "Let me look at the epics.",
                "chunk_chars": 8,
                "tool_calls": [{"name": "list_items", "arguments": {"kind": "epic"}}],
            },
        },
        {
            "match": {
                "purpose": "turn",
                "tool_name": "list_items",
                "last_text_regex": '"item_id":"(?P<id>[^"]+)"',
            },
            "reply": {
                "tool_calls": [{"name": "get_item", "arguments": {"item_id": "{{match:id}}"}}]
            },
        },
        {
            "match": {"purpose": "turn", "tool_name": "get_item"},
            "reply": {"text": "The first epic: {{tool_result}}", "chunk_chars": 12},
        },
    ],
}


def find_buf() -> str:
    found = shutil.which("buf") or (str(CI_BUF) if CI_BUF.is_file() else None)
    if found is None:
        reason = f"buf is not on PATH nor at {CI_BUF} (CI installs it; .ci/run)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return found


@pytest.fixture
async def beads_rig(tmp_path: Path, shared_data: Path) -> AsyncIterator[Rig]:
    started = await start_rig(
        tmp_path / "stack",
        tracker_file=shared_data / "tracker" / "beads-issues.jsonl",
        project_id="beads",
    )
    try:
        scenario_file = tmp_path / "scenario.json"
        scenario_file.write_text(json.dumps(SCENARIO, indent=2))
        started.provider.set_scenario(Scenario.load(scenario_file))
        yield started
    finally:
        await stop_rig(started)


class BufCurl:
    """A running ``buf curl`` on the Chat method: write JSON requests, read JSON responses."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.received: list[dict[str, Any]] = []
        self._buffer = ""
        self._decoder = json.JSONDecoder()

    async def write(self, request: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        await self.process.stdin.drain()

    async def until(self, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read responses until one satisfies ``done``; returns it."""
        assert self.process.stdout is not None
        async with asyncio.timeout(WAIT_S):
            while True:
                while True:
                    text = self._buffer.lstrip()
                    try:
                        document, end = self._decoder.raw_decode(text)
                    except json.JSONDecodeError:
                        break
                    self._buffer = text[end:]
                    self.received.append(document)
                    if done(document):
                        return dict(document)
                chunk = await self.process.stdout.read(65536)
                if not chunk:
                    raise AssertionError(f"buf curl ended early: {self._buffer!r}")
                self._buffer += chunk.decode()

    async def finish(self) -> tuple[int, str]:
        """Close stdin (half-close) and wait for the exit: (exit code, stderr)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        async with asyncio.timeout(WAIT_S):
            rest, errors = await self.process.communicate()
        assert not rest.strip(), rest
        return int(self.process.returncode or 0), errors.decode()


async def test_buf_curl_chat_on_the_beads_project(beads_rig: Rig) -> None:
    rig = beads_rig
    process = await asyncio.create_subprocess_exec(
        find_buf(), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
        "-H", f"authorization: Bearer {rig.token('alice')}",
        "--data", "@-", f"http://{rig.app.address}/{CHAT}",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    buf = BufCurl(process)
    try:
        await buf.write({"requestId": "open-1", "open": {"projectId": "beads", "title": "buf"}})
        opened = await buf.until(lambda r: "sessionOpened" in r or "error" in r)
        assert opened["requestId"] == "open-1" and "sessionOpened" in opened, opened
        await buf.write({"requestId": "send-1", "sendMessage": {"text": "Which epics are there?"}})
        ended = await buf.until(lambda r: "turnEnded" in r or "error" in r)
        code, errors = await buf.finish()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 0, errors
    assert ended["turnEnded"]["reason"] == "TURN_END_REASON_COMPLETED", ended

    events = [next(k for k in r if k not in _ENVELOPE) for r in buf.received]
    tools = [
        (kind, r[kind]["message"]["toolName"])
        for r, kind in zip(buf.received, events, strict=True)
        if kind in ("toolCallStarted", "toolCallFinished")
    ]
    assert tools == [
        ("toolCallStarted", "list_items"), ("toolCallFinished", "list_items"),
        ("toolCallStarted", "get_item"), ("toolCallFinished", "get_item"),
    ]  # fmt: skip
    assert events[:3] == ["sessionOpened", "messageAccepted", "turnStarted"]
    assert events[-2:] == ["assistantMessage", "turnEnded"]
    assert events.count("textDelta") >= 4
    for response, kind in zip(buf.received, events, strict=True):
        if kind == "toolCallFinished":
            assert not response[kind]["message"].get("toolError"), response
    answers = [r["assistantMessage"]["message"]["text"] for r in buf.received
               if "assistantMessage" in r]  # fmt: skip
    final = "".join(r["textDelta"]["text"] for r in buf.received[events.index("toolCallFinished"):]
                    if "textDelta" in r)  # fmt: skip
    assert answers[-1] == final and final.startswith("The first epic: {")

    # ListMessages returns the same transcript, in the same order.
    session_id = opened["sessionOpened"]["session"]["sessionId"]
    streamed = [
        json_format.ParseDict(r[kind]["message"], resources_pb2.Message())
        for r, kind in zip(buf.received, events, strict=True)
        if kind in _MESSAGE_EVENTS
    ]
    assert streamed == await rig.transcript(session_id)
    sequences = [int(r.get("sequence", "0")) for r in buf.received]
    stored = [s for s in sequences if s]
    assert stored == list(range(1, len(stored) + 1))
    first, *_ = rig.requests()
    assert first.project_id == "beads" and first.credential_ref == "beads-credential"


_ENVELOPE = {"sessionId", "turnId", "sequence", "requestId"}
_MESSAGE_EVENTS = {"messageAccepted", "assistantMessage", "toolCallStarted", "toolCallFinished"}
