"""Packaging: an SPDX license expression and the LICENSE file, runtime
dependencies with tested upper bounds, and ``ballet-planner --version``."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from service.cli import main

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_license_is_an_spdx_expression_naming_the_license_file() -> None:
    # The table form (license = {text = ...}) stops building in 2027 (PEP 639).
    assert PROJECT["license"] == "LicenseRef-Ballet-Proprietary"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "proprietary to\nBallet" in text and "No licence is granted" in text


@pytest.mark.parametrize("line", PROJECT["dependencies"])
def test_every_runtime_dependency_has_a_tested_upper_bound(line: str) -> None:
    requirement = Requirement(line)
    operators = {spec.operator for spec in requirement.specifier}
    assert ">=" in operators and "<" in operators, f"{line}: needs a lower and an upper bound"
    installed = importlib.metadata.version(requirement.name)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{line}: the tested version {installed} is outside the range"
    )


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"ballet-planner {PROJECT['version']}\n"
