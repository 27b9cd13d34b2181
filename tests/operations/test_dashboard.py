"""The Grafana dashboard (deploy/grafana/; decision 0243): every query is valid PromQL,
and every metric it and the alerting rules name is one a running planner exports (after
a turn or two) or one the rules record. A metric renamed in service/server/metrics.py
fails here instead of leaving an empty panel or an alert that can never fire."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from ballet.planner.v1 import planner_service_pb2 as pb

from tests.hardening.support import Chat, open_request, refused, start_stack
from tests.operations.prom import (
    DASHBOARD,
    dashboard_queries,
    exported_names,
    metric_names,
    recording_names,
    rules,
)

#: What Grafana puts in place of its variables, for promtool.
_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$namespace": ".*",
    "$job": ".*",
}


def panels() -> list[dict[str, object]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_the_dashboard_is_importable_and_every_panel_asks_the_chosen_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "ballet-planner" and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= set(variables)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["description"], panel["title"]
        grid = panel["gridPos"]
        assert isinstance(grid, dict) and grid["x"] + grid["w"] <= 24
        targets = panel["targets"]
        assert isinstance(targets, list) and targets
        assert len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            # Every query is scoped to the chosen deployment.
            assert 'namespace=~"$namespace", job=~"$job"' in target["expr"], target["expr"]


def test_every_dashboard_query_is_valid_promql(promtool: Path, tmp_path: Path) -> None:
    recorded = []
    for number, query in enumerate(dashboard_queries()):
        for variable, value in _GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        recorded.append({"record": f"dashboard:query_{number}:check", "expr": query})
    check = tmp_path / "dashboard.rules.yml"
    check.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    result = subprocess.run(
        [str(promtool), "check", "rules", str(check)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def named_metrics() -> dict[str, set[str]]:
    """Metric name -> where it is read (``dashboard`` or an alert or record name)."""
    named: dict[str, set[str]] = {}
    for query in dashboard_queries():
        for name in metric_names(query):
            named.setdefault(name, set()).add("dashboard")
    for rule in rules():
        for name in metric_names(rule["expr"]):
            named.setdefault(name, set()).add(rule.get("alert") or rule["record"])
    return named


def sample(exposition: str, line_start: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start}")


@pytest.mark.postgres
async def test_every_metric_the_dashboard_and_the_rules_read_is_exported(
    tmp_path: Path, pg_url: str
) -> None:
    stack = await start_stack(tmp_path / "data", database_url=pg_url)
    try:
        planner = await stack.planner(LIMITS__STREAMS_PER_HUMAN="1")
        alice = stack.auth("alice")
        chat = Chat(planner.stub, alice)
        await chat.open("open-1")
        # A round with a tool call, then a plain answer: turns, rounds, tools, model
        # calls, tokens and first deltas all have samples.
        first = await chat.turn("list the items", "send-1")
        second = await chat.turn("thanks", "send-2")
        assert first.turn_ended.reason == second.turn_ended.reason == 1  # COMPLETED
        # Alice's second stream is refused (one each here), and a call without a token.
        extra = Chat(planner.stub, alice)
        await extra.send(open_request(project_id="demo"))
        error = await extra.ended()
        assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        code, reason, _ = await refused(planner.stub.GetSession(pb.GetSessionRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        url = f"http://{planner.app.metrics_address}/metrics"
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )
        await chat.close()
    finally:
        await stack.stop()

    exported = exported_names(body)
    recorded = recording_names()
    missing = {
        name: sorted(readers)
        for name, readers in named_metrics().items()
        if name not in exported and name not in recorded
    }
    assert missing == {}, "read by the dashboard or the rules, exported by no planner"

    # The metrics the rules were written for have real samples after these turns.
    chat_method = 'grpc_method="/ballet.planner.v1.PlannerService/Chat"'
    assert sample(body, "ballet_planner_turn_first_delta_seconds_count") == 2
    assert sample(body, 'ballet_planner_turns_total{reason="completed"}') == 2
    assert sample(body, 'ballet_planner_turns_total{reason="interrupted"}') == 0
    assert sample(body, "ballet_planner_ready") == 1
    assert sample(body, "ballet_planner_database_connections_limit") == 40  # 10 + 10 + 20
    assert sample(body, "ballet_planner_grpc_server_max_concurrent_rpcs") == 10_000
    assert sample(body, 'ballet_planner_database_errors_total{kind="unavailable"}') == 0
    assert (
        sample(
            body,
            f'ballet_planner_grpc_server_errors_total{{grpc_code="RESOURCE_EXHAUSTED",{chat_method},'
            'reason="TOO_MANY_STREAMS"}',
        )
        == 1
    )
    get_session = 'grpc_method="/ballet.planner.v1.PlannerService/GetSession"'
    assert (
        sample(
            body,
            f'ballet_planner_grpc_server_errors_total{{grpc_code="UNAUTHENTICATED",{get_session},'
            f'reason="{reason}"}}',
        )
        == 1
    )
    assert "alice" not in body and "demo" not in body
