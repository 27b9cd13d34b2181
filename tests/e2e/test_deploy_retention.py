"""``deploy/kubernetes/retention/``: the optional component that runs ``ballet-planner
purge`` as a CronJob (docs/retention.md). Valid against the Kubernetes schemas (the CI
check covers components), consistent with the planner (the policy it patches in is a
configuration the planner accepts, with serve's own job off), shaped like the other pods,
and left out of the default kustomization on purpose."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
COMPONENT = MANIFESTS / "retention"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def cronjob() -> dict[str, Any]:
    return load(COMPONENT / "purge-cronjob.yaml")


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return spec


def merged_environment() -> dict[str, str]:
    """The base ConfigMap's variables with the component's patch, and the database URL
    of the example Secret: what the CronJob's pod (and serve's) read."""
    data = dict(load(MANIFESTS / "configmap.yaml")["data"])
    data.update(load(COMPONENT / "configmap-patch.yaml")["data"])
    env = {key: value for key, value in data.items() if key.startswith("BALLET_PLANNER__")}
    env["BALLET_PLANNER__DATABASE__URL"] = load(MANIFESTS / "secret.example.yaml")["stringData"][
        "database-url"
    ]
    return env


def test_the_component_is_validated_with_the_other_manifests() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "validate_kubernetes.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "retention/purge-cronjob.yaml" in result.stdout
    assert "retention/configmap-patch.yaml" in result.stdout


def test_the_policy_it_patches_in_is_accepted_and_leaves_the_deleting_to_the_cronjob() -> None:
    settings = load_settings(None, merged_environment())
    assert settings.retention.session_idle_days == 90
    assert settings.retention.background is False
    patch = load(COMPONENT / "configmap-patch.yaml")
    assert patch["metadata"]["name"] == load(MANIFESTS / "configmap.yaml")["metadata"]["name"]


def test_it_is_optional_not_part_of_the_default_set() -> None:
    # The planner deletes nothing until an operator chooses how long sessions are kept.
    base = load(MANIFESTS / "kustomization.yaml")
    assert "retention" not in base.get("components", [])
    assert not any("retention" in name for name in base["resources"])
    assert load_settings(None, {}).retention.session_idle_days == 0
    assert load(COMPONENT / "kustomization.yaml")["kind"] == "Component"


def test_the_cronjob_runs_one_purge_at_a_time_like_the_other_pods() -> None:
    spec = cronjob()["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["jobTemplate"]["spec"]["backoffLimit"] >= 1
    pod = pod_spec()
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["args"][0] == "purge"
    assert container["image"] == f"ballet-planner:{VERSION}"
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert user is not None
    assert (
        str(pod["securityContext"]["runAsUser"]),
        str(pod["securityContext"]["runAsGroup"]),
    ) == (user.groups())
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The same configuration and database secret as serve and the migration Job.
    migrate = load(MANIFESTS / "migrate-job.yaml")["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == migrate["envFrom"]
    assert container["env"] == migrate["env"]
    assert cronjob()["metadata"]["labels"]["app.kubernetes.io/version"] == VERSION


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_an_overlay_with_the_component_builds(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    shutil.copytree(MANIFESTS, tmp_path / "base")
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "resources:\n  - ../base\ncomponents:\n  - ../base/retention\n"
    )
    built = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    documents = [d for d in yaml.safe_load_all(built.stdout) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert ("CronJob", "ballet-planner-purge") in kinds
    (config,) = [d for d in documents if d["kind"] == "ConfigMap"]
    assert config["data"]["BALLET_PLANNER__RETENTION__SESSION_IDLE_DAYS"] == "90"
    # Everything else of the base ConfigMap is kept.
    assert config["data"]["BALLET_PLANNER__AUTH__ISSUERS"] == "https://core.example.internal"
