"""Prometheus for the tests of the alerting rules and the dashboard (deploy/prometheus/,
deploy/grafana/).

- ``find_tool`` locates ``promtool`` and ``prometheus`` (Debian's ``prometheus`` package
  has both), and ``prometheus_required`` says whether a missing one fails the tests (CI,
  ``BALLET_REQUIRE_PROMETHEUS=1``) or skips them (a developer's machine), as
  ``tests/pg.py`` does for PostgreSQL.
- ``PrometheusServer`` runs a private Prometheus on loopback: a configuration and a
  storage folder the test owns, a port the kernel picks (read from the server's log),
  and ``stop`` ends it. Nothing of the package's own service is used.
- ``metric_names`` lists the metrics a PromQL expression reads, and ``exported_names``
  the names a ``/metrics`` page exports (histogram and counter suffixes included).

Nothing here imports pytest: ``tests/operations/conftest.py`` decides about skipping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ballet-planner.rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests"
DASHBOARD = ROOT / "deploy" / "grafana" / "ballet-planner.json"
RUNBOOK = ROOT / "docs" / "operations.md"
#: Truthy spellings of an environment flag (as tests/pg.py reads them).
_TRUE = {"1", "true", "yes", "on"}
#: A Prometheus that is not ready in this long is broken, not slow (it starts in ~1 s).
START_TIMEOUT_S = 30.0


class ToolNotFound(RuntimeError):
    """``promtool`` or ``prometheus`` is not installed."""


def prometheus_required() -> bool:
    """Whether a missing ``promtool``/``prometheus`` fails the tests instead of skipping
    them: in CI (``CI`` truthy) or with ``BALLET_REQUIRE_PROMETHEUS=1`` (.ci/run)."""
    return any(
        os.environ.get(flag, "").strip().lower() in _TRUE
        for flag in ("CI", "BALLET_REQUIRE_PROMETHEUS")
    )


def find_tool(name: str) -> Path:
    """The path of ``name`` (``promtool`` or ``prometheus``) on PATH or in /usr/bin.
    Raises ``ToolNotFound`` saying how to install it."""
    found = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if found is None:
        raise ToolNotFound(
            f"{name} not found on PATH: install Prometheus (Debian: apt-get install "
            "prometheus; it brings promtool too)"
        )
    return Path(found)


def rules() -> list[dict[str, Any]]:
    """Every rule of the shipped rules file, recording and alerting, in order."""
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def alerting_rules() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def recording_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard_queries() -> list[str]:
    """The PromQL of every target of every panel of the dashboard, and of its template
    variables' queries (``label_values(...)``' selector)."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", query["query"])
            assert match is not None, query
            queries.append(match.group(1))
    return queries


# --------------------------------------------------------------------------- PromQL names

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: strings, label matchers, ranges,
    grouping clauses and Grafana's ``$variables`` are removed, then every identifier
    that is not a function call, an aggregation or a keyword is a metric name."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\w+", " ", text)
    names: set[str] = set()
    for match in _IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        if match.group(0).lower() in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def exported_names(exposition: str) -> set[str]:
    """Every series name a ``/metrics`` page exports or implies: a counter family's
    ``_total`` (and ``_created``), a histogram's ``_bucket``, ``_sum`` and ``_count``, a
    gauge's own name; families with no sample yet (a labelled metric never observed) are
    exported by name all the same (their HELP and TYPE lines)."""
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


# --------------------------------------------------------------------------- the server


class PrometheusServer:
    """A private Prometheus: ``start(config)`` in ``base_dir``, the HTTP API on
    ``address``, ``stop()`` ends it (it never outlives the test)."""

    def __init__(self, binary: Path, base_dir: Path) -> None:
        self.binary = binary
        self.base_dir = base_dir
        self.log_file = base_dir / "prometheus.log"
        self.address = ""
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, config: dict[str, Any]) -> None:
        """Write ``config`` as prometheus.yml and start on a free loopback port; returns
        once the server says it is ready. Raises RuntimeError with its log otherwise."""
        config_file = self.base_dir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        with self.log_file.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    str(self.binary),
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={self.base_dir / 'data'}",
                    "--web.listen-address=127.0.0.1:0",
                    "--log.level=info",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.base_dir,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log()}")
            log_text = self.log()
            found = re.search(r'msg="Listening on" address=(\S+)', log_text)
            if found and "Server is ready to receive web requests" in log_text:
                self.address = found.group(1)
                return
            time.sleep(0.05)
        raise RuntimeError(f"prometheus not ready within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data``; raises on an API error."""
        query = urllib.parse.urlencode(params)
        url = f"http://{self.address}/api/v1/{path}" + (f"?{query}" if query else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self) -> list[dict[str, Any]]:
        """The active alerts (pending and firing), as ``/api/v1/alerts`` lists them."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector result."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; waits for the process to be gone."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
