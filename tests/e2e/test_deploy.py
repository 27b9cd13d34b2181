"""``deploy/kubernetes/`` (issue 16, Deployment): valid against the Kubernetes schemas
(the CI check), and consistent with the planner and its image: the ConfigMap is a
configuration the planner accepts, the probes ask the health service, the pod's grace
period outlasts the planner's, the pods run as the image's non-root user, and names,
keys, paths and versions agree across the files."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from service.config import load_settings
from service.server.root import LIVENESS_SERVICE

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((MANIFESTS / name).read_text())
    return document


def pod_spec(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = load(name)["spec"]["template"]["spec"]
    return spec


def volume(name: str, volume_name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(v for v in pod_spec(name)["volumes"] if v["name"] == volume_name)
    return found


def test_the_manifests_validate_against_the_kubernetes_schemas() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "validate_kubernetes.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deployment.yaml" in result.stdout and "migrate-job.yaml" in result.stdout


def configured_environment() -> dict[str, str]:
    config = load("configmap.yaml")["data"]
    secret = load("secret.example.yaml")["stringData"]
    env = {key: value for key, value in config.items() if key.startswith("BALLET_PLANNER__")}
    env["BALLET_PLANNER__DATABASE__URL"] = secret["database-url"]
    return env


def test_the_configmap_is_a_configuration_the_planner_accepts() -> None:
    settings = load_settings(None, configured_environment())
    assert not settings.dev_mode
    assert not settings.database.is_sqlite
    container = pod_spec("deployment.yaml")["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert settings.auth.jwks_path == Path(mounts["jwks"]) / "jwks.json"
    secrets = Path(mounts["secrets"])
    for name in ("gateway", "tracker", "skills", "knowledge"):
        # One credential per dependency (decision 0153), each a key of the Secret.
        token_file = getattr(settings.dependencies, name).service_token_file
        assert token_file == secrets / f"{name}-token"
    assert settings.auth.page_token_key_file == secrets / "page-token-keys"
    mounted = {item["path"] for item in volume("deployment.yaml", "secrets")["secret"]["items"]}
    assert mounted == {
        f"{name}-token" for name in ("gateway", "tracker", "skills", "knowledge")
    } | {"page-token-keys"}
    assert mounts["data"] == "/var/lib/ballet-planner"


def test_the_pod_outlasts_the_planners_shutdown_grace() -> None:
    grace_s = load_settings(None, configured_environment()).server.grace_s
    assert pod_spec("deployment.yaml")["terminationGracePeriodSeconds"] > grace_s


def test_probes_are_native_grpc_on_the_health_service() -> None:
    container = pod_spec("deployment.yaml")["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["grpc"] == {"port": ports["grpc"]}  # service "": readiness (SPEC 8)
    assert liveness["grpc"] == {"port": ports["grpc"], "service": LIVENESS_SERVICE}
    assert container["startupProbe"]["grpc"]["service"] == LIVENESS_SERVICE


def test_pods_run_as_the_images_non_root_user_with_requests() -> None:
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert user is not None
    for name in ("deployment.yaml", "migrate-job.yaml"):
        spec = pod_spec(name)
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user.groups()
        (container,) = spec["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        assert container["image"] == f"ballet-planner:{VERSION}"


def test_configuration_comes_from_the_configmap_and_secrets_from_the_secret() -> None:
    config_name = load("configmap.yaml")["metadata"]["name"]
    secret = load("secret.example.yaml")
    for name in ("deployment.yaml", "migrate-job.yaml"):
        (container,) = pod_spec(name)["containers"]
        assert container["envFrom"] == [{"configMapRef": {"name": config_name}}]
        for variable in container["env"]:
            ref = variable["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"]
            assert ref["key"] in secret["stringData"]


def test_the_migration_job_is_named_for_the_release_and_migrates() -> None:
    job = load("migrate-job.yaml")
    assert job["metadata"]["name"] == "ballet-planner-migrate-" + VERSION.replace(".", "-")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_the_service_and_the_budget_select_the_deployments_pods() -> None:
    labels = load("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    service = load("service.yaml")["spec"]
    assert service["selector"].items() <= labels.items()
    assert {port["targetPort"] for port in service["ports"]} == {"grpc", "metrics"}
    budget = load("pdb.yaml")["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert load("deployment.yaml")["spec"]["replicas"] > budget["maxUnavailable"]
