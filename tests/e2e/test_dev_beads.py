"""``ballet-planner dev`` on the real beads data, as a new engineer runs it (README.md and
devstack/gateway/scripted.py).

One ``dev`` process for the module: the beads export, the ADRs and the skills of
``../shared/data``, the built-in demo scenario (no ``--scenario``), free ports. The
expected numbers are computed from the export with the filter its README names. ``buf
curl`` is a client we did not write; a token comes from ``ballet-planner token``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from devstack.dev import DEPENDENCY_SERVICES
from tests.e2e.dev_support import DevProcess, clean_env, command, find_buf, run_cli

READY_LIMIT_S = 30.0
PROJECT = "beads"
_INTERNAL_TYPES = {"event", "molecule", "agent", "gate"}


def _kept(row: dict[str, Any]) -> bool:
    # The filter ../shared/data/README.md names for internal rows.
    return (
        row.get("issue_type") not in _INTERNAL_TYPES
        and row.get("status") != "tombstone"
        and not row.get("ephemeral")
        and not str(row.get("id", "")).startswith("bd-wisp")
    )


@pytest.fixture(scope="module")
def export(shared_data: Path) -> list[dict[str, Any]]:
    path = shared_data / "tracker" / "beads-issues.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if _kept(row)]


@pytest.fixture(scope="module")
def dev(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcess]:
    cwd = tmp_path_factory.mktemp("dev-beads")
    started = DevProcess.start(
        [
            "--data-dir",
            "data",
            "--tracker",
            str(shared_data / "tracker" / "beads-issues.jsonl"),
            "--project",
            PROJECT,
            "--knowledge",
            str(shared_data / "knowledge" / "adr"),
            "--skills",
            str(shared_data / "skills"),
        ],
        cwd,
    )
    try:
        yield started
    finally:
        code, out = started.stop()
        assert code == 0, f"dev exited with {code}:\n{out}\n{started.log()}"
        assert "ballet-planner dev: stopped" in out


def test_ready_within_30_s_and_says_how_to_connect(dev: DevProcess) -> None:
    assert dev.ready_s < READY_LIMIT_S, f"ready after {dev.ready_s:.1f} s"
    banner = dev.banner
    # The data directory absolute, so the lines work pasted in any folder.
    assert re.search(
        rf"ballet-planner chat --project {PROJECT} --user alice --data-dir /\S*/data\b", banner
    ), banner
    assert re.search(r"ballet-planner token --user alice --data-dir /\S*/data\b", banner), banner
    assert "buf curl" in banner and f"http://{dev.planner}/" in banner
    assert (dev.cwd / "data" / "planner.db").exists()
    assert (dev.cwd / "data" / "devstack.db").exists()


def test_reflection_on_the_devstack_lists_the_four_dependency_services(dev: DevProcess) -> None:
    with grpc.insecure_channel(dev.devstack) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert set(DEPENDENCY_SERVICES) <= services
        pool = DescriptorPool(database)
        assert pool.FindServiceByName("ballet.llm.v1.GatewayService").methods


def test_buf_curl_reads_the_beads_project_with_a_token_from_the_cli(
    dev: DevProcess, export: list[dict[str, Any]]
) -> None:
    buf = find_buf()
    minted = run_cli(["token", "--user", "alice", "--data-dir", "data"], dev.cwd)
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip()

    def curl(method: str, body: dict[str, Any]) -> dict[str, Any]:
        result = subprocess.run(
            [
                buf,
                "curl",
                "--protocol",
                "grpc",
                "--http2-prior-knowledge",
                "-H",
                f"authorization: Bearer {token}",
                "-d",
                json.dumps(body),
                f"http://{dev.devstack}/ballet.tracker.v1.TrackerService/{method}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        answer: dict[str, Any] = json.loads(result.stdout)
        return answer

    epics = [row["id"] for row in export if row.get("issue_type") == "epic"]
    listed = curl("ListItems", {"projectId": PROJECT, "kind": "ITEM_KIND_EPIC", "pageSize": 1000})
    assert listed["totalSize"] == len(epics)
    assert sorted(item["itemId"] for item in listed["items"]) == sorted(epics)

    kept = {row["id"] for row in export}
    blocked = next(
        (row, dep["depends_on_id"])
        for row in export
        for dep in row.get("dependencies") or ()
        if dep.get("type") == "blocks" and dep["depends_on_id"] in kept
    )
    item = curl("GetItem", {"projectId": PROJECT, "itemId": blocked[0]["id"]})["item"]
    assert item["title"] == blocked[0]["title"]
    assert blocked[1] in item["blockedByIds"]

    runnable = curl("ListRunnableTickets", {"projectId": PROJECT, "pageSize": 50})
    assert runnable["items"] and runnable["totalSize"] >= len(runnable["items"])
    assert {item["kind"] for item in runnable["items"]} == {"ITEM_KIND_TICKET"}

    found = curl("SearchProject", {"projectId": PROJECT, "query": blocked[0]["title"]})
    assert found["itemsSearched"] is True
    assert blocked[0]["id"] in {hit.get("item", {}).get("itemId") for hit in found["results"]}


def test_the_printed_buf_curl_lines_work_as_printed(dev: DevProcess) -> None:
    buf = find_buf()
    lines = [
        line.strip() for line in dev.banner.splitlines() if line.strip().startswith("buf curl -")
    ]
    assert len(lines) == 2
    # The shell finds buf and ballet-planner on PATH, as in a developer's terminal.
    path = os.pathsep.join([str(Path(buf).parent), str(Path(command()[0]).parent)])
    env = clean_env(PATH=path + os.pathsep + os.environ.get("PATH", ""))
    outputs = []
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], cwd=dev.cwd, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        outputs.append(result.stdout)
    sessions, services = outputs
    assert isinstance(json.loads(sessions), dict)  # a ListSessionsResponse
    assert set(DEPENDENCY_SERVICES) <= set(services.split())


def test_chat_message_with_the_demo_scenario_prints_the_answer_and_tool_calls(
    dev: DevProcess,
) -> None:
    # No --scenario: the built-in demo scenario answers a question about open epics.
    result = dev.chat("--project", PROJECT, "--message", "What are the open epics?")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Let me list the open epics." in out
    assert '-> list_items {"kind":"epic","state":"open"}' in out
    assert "<- list_items: ok, " in out
    assert "Here are the items the tracker returned:" in out
    assert re.search(r"^- bd-\S+: ", out, re.MULTILINE), out  # the result, one item a line
    assert "[COMPLETED: 1 round" in out


def test_chat_json_prints_every_response_as_one_json_line(dev: DevProcess) -> None:
    result = dev.chat("--project", PROJECT, "--json", "--message", "What can I work on?")
    assert result.returncode == 0, result.stdout + result.stderr
    responses = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = [next(key for key in r if key not in _ENVELOPE) for r in responses]
    assert kinds[0] == "sessionOpened"
    assert kinds[1:3] == ["messageAccepted", "turnStarted"]
    assert "textDelta" in kinds
    assert kinds[-1] == "turnEnded"
    assert responses[-1]["turnEnded"]["reason"] == "TURN_END_REASON_COMPLETED"
    calls = [
        r["toolCallStarted"]["message"]["toolName"] for r in responses if "toolCallStarted" in r
    ]
    assert calls == ["list_runnable"]
    sequences = [int(r["sequence"]) for r in responses if "sequence" in r]
    assert sequences == list(range(1, len(sequences) + 1))


_ENVELOPE = {"sessionId", "turnId", "sequence", "requestId"}
