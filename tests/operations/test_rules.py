"""The alerting and recording rules (deploy/prometheus/; decision 0240): ``promtool check
rules`` and ``promtool test rules`` pass, every alert is unit-tested both firing and not
firing, and every alert pages or tickets with a summary and a runbook entry that exists in
docs/operations.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operations.prom import (
    RULE_TESTS,
    RULES,
    RUNBOOK,
    alerting_rules,
    metric_names,
    prometheus_required,
    recording_names,
    rules,
)


def run(argv: list[str | Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULES.parent,
        stdin=subprocess.DEVNULL,
    )


def test_promtool_checks_the_rules(promtool: Path) -> None:
    result = run([promtool, "check", "rules", RULES])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass(promtool: Path) -> None:
    files = sorted(RULE_TESTS.glob("*.test.yml"))
    assert files
    result = run([promtool, "test", "rules", *files])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files), result.stdout


def rule_tests() -> list[dict[str, Any]]:
    found = []
    for path in sorted(RULE_TESTS.glob("*.test.yml")):
        document = yaml.safe_load(path.read_text())
        # The shipped file itself, never a copy.
        assert [(path.parent / f).resolve() for f in document["rule_files"]] == [RULES]
        found.extend(document["tests"])
    return found


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in rule_tests():
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerting_rules()}
    assert names - fires == set(), "alerts never seen firing"
    assert names - quiet == set(), "alerts never seen staying quiet"
    assert (fires | quiet) - names == set(), "tests of alerts that do not exist"


def runbook_anchors() -> dict[str, str]:
    """The third-level headings of docs/operations.md, by their GitHub anchor."""
    headings = re.findall(r"^### (.+)$", RUNBOOK.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-"): h for h in headings}


@pytest.mark.parametrize("rule", alerting_rules(), ids=lambda rule: str(rule["alert"]))
def test_every_alert_pages_or_tickets_and_links_its_runbook_entry(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert re.fullmatch(r"BalletPlanner[A-Z]\w+", name)
    assert rule["labels"]["severity"] in ("page", "ticket")
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    assert annotations["runbook_url"] == f"docs/operations.md#{name.lower()}"
    assert runbook_anchors().get(name.lower()) == name, "no runbook entry for the alert"
    if rule["labels"]["severity"] == "page":
        # A page waits out a blip: one evaluation is never enough to wake someone.
        assert re.fullmatch(r"\d+m", rule.get("for", "")), "a page needs a for: in minutes"


def test_the_runbook_has_an_entry_for_each_alert_and_no_other() -> None:
    names = {rule["alert"] for rule in alerting_rules()}
    entries = {h for h in runbook_anchors().values() if h.startswith("BalletPlanner")}
    assert entries == names


def test_recording_rules_are_named_level_metric_operation_and_read_before_written() -> None:
    # level:metric:operations (Prometheus' naming practice); a rule reads only recorded
    # series defined above it, so one evaluation pass is consistent.
    seen: set[str] = set()
    for rule in rules():
        if "record" not in rule:
            continue
        assert re.fullmatch(r"ballet_planner:[a-z_]+:[a-z0-9_]+", rule["record"])
        read = {n for n in metric_names(rule["expr"]) if ":" in n}
        assert read <= seen, f"{rule['record']} reads {read - seen} before they are recorded"
        seen.add(rule["record"])
    assert seen == recording_names()


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (namespace, le) (rate(a_bucket{le="2.5", x=~"y|z"}'
        '[5m]))) > 5 and on (job) b_info or 0 * c:d:rate5m{namespace=~"$namespace"}'
        " / on (job) group_left sum_over_time(e[$__rate_interval]) unless bool f offset 5m"
        ' * ignoring (x) group_right (y) g{a="by (le) h"}'
    )
    assert metric_names(expr) == {"a_bucket", "b_info", "c:d:rate5m", "e", "f", "g"}


@pytest.mark.parametrize(
    ("environ", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"BALLET_REQUIRE_PROMETHEUS": "1"}, True),
        ({"BALLET_REQUIRE_PROMETHEUS": "0"}, False),
    ],
)
def test_a_missing_prometheus_fails_in_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], required: bool
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BALLET_REQUIRE_PROMETHEUS", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert prometheus_required() is required
