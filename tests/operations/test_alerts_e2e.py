"""The readiness alert against a real Prometheus (decision 0241): a private Prometheus on
loopback scrapes a running ``ballet-planner serve`` on PostgreSQL every second and
evaluates the shipped rules every second; the test stops the database and sees the alert.

The shipped ``BalletPlannerNotReady`` waits 1 minute (``for: 1m``) before it fires, the
right wait in production and too long for a test. So Prometheus loads the shipped file
as it is, and beside it a copy of that one rule with ``for: 0s`` (its expression and
labels unchanged, plus ``e2e: copy``): the shipped rule turns pending and the copy fires
on the same scraped series. What ``for:`` adds is the unit tests' part
(deploy/prometheus/tests/readiness.test.yml: pending at the first minute, firing after).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.hardening.support import PlannerProcess, eventually, serve_process, start_stack
from tests.operations.prom import RULES, PrometheusServer, alerting_rules
from tests.pg import PgCluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ALERT = "BalletPlannerNotReady"
#: Bounds on waits for what Prometheus shows; a passing run takes a few seconds of each.
SCRAPED_S = 30.0
FIRES_S = 30.0


def shipped_rule() -> dict[str, Any]:
    (rule,) = [r for r in alerting_rules() if r["alert"] == ALERT]
    return rule


def write_copy(path: Path) -> dict[str, Any]:
    """The shipped rule with ``for: 0s`` and an ``e2e`` label, in a rules file of its own."""
    rule = copy.deepcopy(shipped_rule())
    rule["for"] = "0s"
    rule["labels"] = {**rule["labels"], "e2e": "copy"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "e2e-copy", "rules": [rule]}]}))
    return rule


def readiness_alerts(prometheus: PrometheusServer) -> list[dict[str, Any]]:
    return [a for a in prometheus.alerts() if a["labels"]["alertname"] == ALERT]


async def test_the_readiness_alert_fires_when_the_database_stops(
    tmp_path: Path,
    own_pg_cluster: PgCluster,
    prometheus_binary: Path,
    record_property: Callable[[str, object], None],
) -> None:
    own_pg_cluster.create_database("planner")
    stack = await start_stack(tmp_path / "data", database_url=own_pg_cluster.url("planner"))
    prometheus_dir = tmp_path / "prometheus"
    prometheus_dir.mkdir()
    prometheus = PrometheusServer(prometheus_binary, prometheus_dir)
    served: PlannerProcess | None = None
    try:
        served = await serve_process(
            stack, tmp_path / "planner.log", SERVER__HEALTH_CHECK_INTERVAL_S="0.2"
        )
        rule = write_copy(prometheus_dir / "e2e-copy.rules.yml")
        assert rule["expr"] == shipped_rule()["expr"]
        await asyncio.to_thread(
            prometheus.start,
            {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(RULES), str(prometheus_dir / "e2e-copy.rules.yml")],
                "scrape_configs": [
                    {
                        "job_name": "ballet-planner",
                        "static_configs": [{"targets": [served.metrics_address]}],
                    }
                ],
            },
        )

        # Scraped and ready, and the rules evaluated on it (a rate needs two scrapes):
        # nothing about readiness is pending.
        async def evaluated() -> bool:
            ready = await asyncio.to_thread(prometheus.query, "ballet_planner_ready")
            rates = await asyncio.to_thread(prometheus.query, "ballet_planner:turns:rate5m")
            return [float(s["value"][1]) for s in ready] == [1.0] and bool(rates)

        await eventually(evaluated, SCRAPED_S)
        assert await asyncio.to_thread(readiness_alerts, prometheus) == []

        stopped_at = time.monotonic()
        await asyncio.to_thread(own_pg_cluster.stop, "fast")

        async def fired() -> bool:
            alerts = await asyncio.to_thread(readiness_alerts, prometheus)
            states = {(a["labels"].get("e2e", "shipped"), a["state"]) for a in alerts}
            return {("copy", "firing"), ("shipped", "pending")} <= states

        await eventually(fired, FIRES_S)
        record_property("alert_fired_after_stop_s", round(time.monotonic() - stopped_at, 2))

        alerts = {a["labels"].get("e2e", "shipped"): a for a in readiness_alerts(prometheus)}
        expected = {"alertname": ALERT, "severity": "page", "job": "ballet-planner"}
        assert alerts["shipped"]["labels"] == expected
        assert alerts["copy"]["labels"] == {**expected, "e2e": "copy"}
        annotations = alerts["copy"]["annotations"]
        assert annotations["runbook_url"] == "docs/operations.md#balletplannernotready"
        assert annotations["summary"] == "No planner replica is ready in /ballet-planner"
        # The shipped rule waits its minute: Prometheus holds it with that duration.
        groups = prometheus.api("rules", type="alert")["groups"]
        loaded = {r["name"]: r for g in groups if g["name"] != "e2e-copy" for r in g["rules"]}
        assert loaded[ALERT]["duration"] == 60
        # The health monitor's failed pings are counted as database errors.
        errors = prometheus.query('ballet_planner_database_errors_total{kind="unavailable"}')
        assert errors and float(errors[0]["value"][1]) > 0
    finally:
        await asyncio.to_thread(prometheus.stop)
        if served is not None:
            served.stop()
        await stack.stop()
