"""``deploy/kubernetes/``: valid against the Kubernetes schemas
(the CI check), and consistent with the planner and its image: the ConfigMap is a
configuration the planner accepts, the probes ask the health service, the pod's grace
period outlasts the planner's (preStop included), the autoscaler owns the replicas within
the disruption budget and the database's connections, the pods run as the image's
non-root user, and names, keys, paths and versions agree across the files."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config import SHUTDOWN_OVERHEAD_S, load_settings
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


#: What the pod's grace period must leave after the planner's own (seconds): the process
#: exits within ``server.grace_s`` (decision 0181), and the kubelet's SIGTERM reaching it
#: and the runtime reaping it take a little more.
KILL_MARGIN_S = 5.0


def pre_stop_s(container: dict[str, Any]) -> float:
    """How long the container's preStop hook may take (0 without one). Kubernetes counts
    it in the grace period and sends SIGTERM only after it; a hook whose length cannot be
    read from the manifest (an HTTP call, a script) fails the test."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] in ("sleep", "/bin/sleep"):
        return float(command[1])
    raise AssertionError(f"a preStop hook of unknown length: {hook}")


@pytest.mark.parametrize("source", ["configmap", "defaults"])
def test_kubernetes_never_kills_a_graceful_stop(source: str) -> None:
    # The ConfigMap's server.grace_s, and the default a ConfigMap without it would get.
    environ = configured_environment()
    if source == "defaults":
        environ.pop("BALLET_PLANNER__SERVER__GRACE_S")
    settings = load_settings(None, environ)
    spec = pod_spec("deployment.yaml")
    (container,) = spec["containers"]
    needed = pre_stop_s(container) + settings.server.grace_s + KILL_MARGIN_S
    assert spec["terminationGracePeriodSeconds"] >= needed
    # The grace period itself holds the planner's own shutdown (load_settings checks it).
    assert settings.server.grace_s >= settings.planner.cancel_grace + SHUTDOWN_OVERHEAD_S


def test_a_pre_stop_hook_counts_against_the_grace_period() -> None:
    assert pre_stop_s({}) == 0
    assert pre_stop_s({"lifecycle": {"preStop": {"sleep": {"seconds": 5}}}}) == 5
    assert pre_stop_s({"lifecycle": {"preStop": {"exec": {"command": ["sleep", "3"]}}}}) == 3
    with pytest.raises(AssertionError):
        pre_stop_s({"lifecycle": {"preStop": {"httpGet": {"path": "/drain", "port": 9464}}}})


def test_the_autoscaler_scales_the_deployment_on_cpu_within_the_budget() -> None:
    hpa = load("hpa.yaml")["spec"]
    deployment = load("deployment.yaml")
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    # The autoscaler owns the count: a replicas field would reset it on every apply.
    assert "replicas" not in deployment["spec"]
    (metric,) = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 80
    # Utilization is a share of the request, so the container must have one.
    (container,) = pod_spec("deployment.yaml")["containers"]
    assert container["resources"]["requests"]["cpu"]
    assert "cpu" not in container["resources"].get("limits", {})
    # A drain (pdb.yaml) always leaves a replica serving; scaling down is one at a time.
    budget = load("pdb.yaml")["spec"]
    assert hpa["minReplicas"] > budget["maxUnavailable"]
    assert hpa["maxReplicas"] > hpa["minReplicas"]
    assert [p["value"] for p in hpa["behavior"]["scaleDown"]["policies"]] == [1]


def test_the_autoscalers_replicas_fit_the_database_connections() -> None:
    # Each replica may hold pool_size + max_overflow + hot_pool_size + 1 connections
    # (docs/configuration.md); the most replicas must fit a PostgreSQL with
    # max_connections = 500 (its default of 100 holds two replicas), leaving 50 for the
    # migration Job, operators and the reserved superuser slots.
    database = load_settings(None, configured_environment()).database
    per_replica = database.pool_size + database.max_overflow + database.hot_pool_size + 1
    assert load("hpa.yaml")["spec"]["maxReplicas"] * per_replica <= 450


def test_probes_are_native_grpc_on_the_health_service() -> None:
    container = pod_spec("deployment.yaml")["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["grpc"] == {"port": ports["grpc"]}  # service "": readiness
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
