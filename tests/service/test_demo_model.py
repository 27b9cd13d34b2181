"""The built-in demo model shows the product (devstack/gateway/scripted.py): every question
the README suggests finds something in the demo project, a proposal becomes a changeset
that waits for a human, skills are listed, and for anything else the model says what it
is and suggests the project's own items, on the demo project and on an imported one."""

from __future__ import annotations

import io
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ballet.planner.v1 import chat_pb2

from ballet_chat.client import ChatClient, ChatOptions
from ballet_common.grpc.channels import make_channel
from devstack.dev import DevApp, DevOptions, start_dev

REPO = Path(__file__).resolve().parents[2]
ENV = {"BALLET_PLANNER__SERVER__METRICS_ADDRESS": "", "BALLET_PLANNER__SERVER__GRACE_S": "7"}


def readme_questions() -> list[str]:
    """The questions listed under the README's "What the demo model understands"."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("### What the demo model understands", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^- `([^`]+)`", section, re.MULTILINE)


async def ask(client: ChatClient, text: str) -> str:
    """Send ``text`` and return what the client showed for the turn."""
    out = client.renderer.out
    assert isinstance(out, io.StringIO)
    before = len(out.getvalue())
    await client.send(text)
    while client.busy:
        event = await client.next_event()
        assert isinstance(event, chat_pb2.ChatResponse), event
    return out.getvalue()[before:]


async def started(options: DevOptions) -> tuple[DevApp, ChatClient]:
    app = await start_dev(options, ENV)
    token = app.stack.token("alice")
    client = ChatClient(
        ChatOptions(address=app.planner.address, token=token, project_id=options.project),
        io.StringIO(),
        io.StringIO(),
    )
    client.channel = make_channel(app.planner.address, tls=None, insecure=False)
    await client.open(title="demo")
    return app, client


@pytest.fixture(scope="module")
async def demo(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatClient]:
    folder = tmp_path_factory.mktemp("demo-model")
    app, client = await started(
        DevOptions(data_dir=folder, address="127.0.0.1:0", devstack_address="127.0.0.1:0")
    )
    try:
        yield client
    finally:
        await client.close()
        await app.stop()


def test_the_readme_suggests_questions() -> None:
    assert len(readme_questions()) >= 6, readme_questions()


@pytest.mark.parametrize("question", readme_questions())
async def test_every_readme_question_finds_something_in_the_demo_project(
    demo: ChatClient, question: str
) -> None:
    shown = await ask(demo, question)
    assert "  <- " in shown and ": ok" in shown, f"{question}\n{shown}"
    assert ": ok, 0 " not in shown and "error" not in shown, f"{question}\n{shown}"
    assert "[COMPLETED: 1 round" in shown, shown


async def test_a_proposal_becomes_a_changeset_that_waits_for_a_human(demo: ChatClient) -> None:
    shown = await ask(demo, "Please propose a ticket to add retries")
    assert "-> propose_changeset" in shown and "- create item: add retries (" in shown, shown
    assert re.search(r"\*\* changeset \S+ proposed: a human applies or rejects it", shown)
    assert "Nothing changes until a human applies it" in shown


async def test_skills_are_listed(demo: ChatClient) -> None:
    shown = await ask(demo, "What skills are there?")
    assert "<- list_skills: ok, 3 skills" in shown and "demo-planning" in shown, shown


async def test_anything_else_suggests_the_demo_projects_items(demo: ChatClient) -> None:
    shown = await ask(demo, "hello")
    assert "I am the demo model" in shown
    assert "PAN-4" in shown  # an open epic of the demo project, from the tool result
    assert "--provider openai" in shown


MINI_EXPORT = [
    {"id": "mini-1", "title": "Offline sync", "status": "open", "issue_type": "epic"},
    {"id": "mini-2", "title": "Conflict view", "status": "open", "issue_type": "epic"},
    {
        "id": "mini-3",
        "title": "Queue writes while offline",
        "status": "open",
        "priority": 1,
        "issue_type": "task",
        "dependencies": [{"issue_id": "mini-3", "depends_on_id": "mini-1", "type": "parent-child"}],
    },
]


async def test_on_an_imported_project_the_fallback_suggests_its_own_items(
    tmp_path: Path,
) -> None:
    export = tmp_path / "issues.jsonl"
    export.write_text("".join(json.dumps(row) + "\n" for row in MINI_EXPORT))
    app, client = await started(
        DevOptions(
            data_dir=tmp_path / "data",
            tracker_file=export,
            project_id="mini",
            address="127.0.0.1:0",
            devstack_address="127.0.0.1:0",
        )
    )
    try:
        shown = await ask(client, "hello")
    finally:
        await client.close()
        await app.stop()
    assert "mini-1" in shown and "mini-2" in shown, shown
    assert "PAN-" not in shown, shown


async def test_a_failed_tool_call_is_reported_as_a_failure(demo: ChatClient) -> None:
    # An error result (here NOT_FOUND) gets the failure answer, never the tool's own
    # success text ("Here is the item:"), whichever tool failed.
    shown = await ask(demo, "Tell me about PAN-999")
    assert "<- get_item: error NOT_FOUND" in shown, shown
    assert "That did not work: the tool call failed" in shown, shown
    assert "Here is the item" not in shown, shown
