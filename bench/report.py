"""The benchmark's output: rows of figures, a markdown table and a JSON document.

A ``Row`` is one figure: its value, the min/median/max over repeated runs when it is a
time or a rate, the sample size, the bare figure it is compared with and the ratio, and
the docs/performance.md target it answers with its verdict.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.stats import Repeated


@dataclass
class Row:
    """One figure of the report. ``value``, ``low``, ``high`` are in ``unit``;
    ``ratio`` is ``value / reference`` (None when the figure has no bare counterpart)."""

    section: str
    key: str
    label: str
    unit: str
    value: float
    low: float | None = None
    high: float | None = None
    samples: str = ""
    reference: str = ""
    reference_value: float | None = None
    ratio: float | None = None
    target: str = ""
    verdict: str = ""
    note: str = ""


@dataclass
class Report:
    """Everything one run produced."""

    mode: str
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def find(self, key: str) -> Row:
        for row in self.rows:
            if row.key == key:
                return row
        raise KeyError(key)


def time_row(
    section: str,
    key: str,
    label: str,
    figure: Repeated,
    *,
    scale: float = 1000.0,
    unit: str = "ms",
    **extra: Any,
) -> Row:
    """A row for a repeated time (seconds, shown in ``unit`` after ``scale``)."""
    return Row(
        section=section,
        key=key,
        label=label,
        unit=unit,
        value=figure.value * scale,
        low=figure.low * scale,
        high=figure.high * scale,
        samples=f"{len(figure.runs)}x{figure.per_run}",
        **extra,
    )


def compare(row: Row, reference_label: str, reference_value: float) -> Row:
    """Set the bare reference of ``row`` and its ratio."""
    row.reference = reference_label
    row.reference_value = reference_value
    row.ratio = row.value / reference_value if reference_value else None
    return row


def judge(row: Row, target: str, met: bool) -> Row:
    row.target = target
    row.verdict = "met" if met else "MISSED"
    return row


def machine() -> dict[str, Any]:
    """What this machine is: CPU model and count, memory, kernel, Python."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    import os

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def markdown(report: Report) -> str:
    """The report as markdown: the table per section, then limits and notes."""
    lines = [
        f"Mode: {report.mode}; machine: {report.machine.get('cores')} cores "
        f"({report.machine.get('cpu')}), {report.machine.get('memory_gib')} GiB, "
        f"Linux {report.machine.get('kernel')}, Python {report.machine.get('python')}; "
        f"run took {report.total_s:.0f} s.",
        "",
    ]
    section = None
    for row in report.rows:
        if row.section != section:
            section = row.section
            lines += [
                "",
                f"### {section}",
                "",
                "| Figure | Value | Unit | min-max of runs | n | Bare reference | Ratio | Target "
                "| Result |",
                "| --- | ---: | --- | --- | --- | --- | ---: | --- | --- |",
            ]
        spread = (
            f"{_number(row.low)}-{_number(row.high)}"
            if row.low is not None and row.high is not None
            else ""
        )
        reference = f"{row.reference} ({_number(row.reference_value)})" if row.reference else ""
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
        label = row.label + (f" ({row.note})" if row.note else "")
        lines.append(
            f"| {label} | {_number(row.value)} | {row.unit} | {spread} | {row.samples} | "
            f"{reference} | {ratio} | {row.target} | {row.verdict} |"
        )
    if report.profile:
        lines += ["", "### Profile of the per-round path (planner process, py-spy)", ""]
        profile = report.profile
        lines.append(f"{profile.get('samples', 0)} samples. By component (innermost frame):")
        lines.append("")
        for name, share in list(profile.get("components", {}).items())[:8]:
            lines.append(f"- {name}: {share * 100:.1f}%")
        lines += ["", "By innermost planner function (its own work and direct library calls):", ""]
        for entry in profile.get("planner_functions", [])[:10]:
            parts = ", ".join(
                f"{name} {share * 100:.1f}%" for name, share in entry["components"].items()
            )
            lines.append(f"- {entry['function']}: {entry['share'] * 100:.1f}% ({parts})")
        lines += ["", "Inclusive (stack passes through):", ""]
        for name, share in profile.get("inclusive", [])[:10]:
            lines.append(f"- {name}: {share * 100:.1f}%")
    if report.limits:
        lines += ["", "### Limits met on the way", ""]
        lines += [f"- {limit}" for limit in report.limits]
    if report.notes:
        lines += ["", "### Notes", ""]
        lines += [f"- {note}" for note in report.notes]
    if report.phases_s:
        phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in report.phases_s.items())
        lines += ["", f"Phases: {phases}."]
    return "\n".join(lines) + "\n"


def write(report: Report, out: Path, name: str = "latest") -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    md_path = out / f"{name}.md"
    document = asdict(report)
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path
