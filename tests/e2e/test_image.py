"""The production image: its ``CMD`` and ``HEALTHCHECK`` work with environment
variables alone, in a writable data directory that is the working directory, and its
build context holds everything the wheel needs.

There is no container engine here, so the test reads the Dockerfile's runtime stage (its
``ENV``, ``WORKDIR``, ``ENTRYPOINT``, ``CMD`` and ``HEALTHCHECK``) and runs those commands
as the image would: the image's environment plus what a deployment adds (a key set, the
service token file, plaintext allowed), no configuration file, ports moved to free ones.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.e2e.dev_support import command
from tests.e2e.test_cli_serve import clean_env, serve_address, wait_serving

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    """The runtime stage of the Dockerfile, as the image runs it."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)


def stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The Dockerfile's stages: name -> (what it is FROM, its instructions in order)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            words = rest.split()
            current = []
            found[words[-1]] = (words[0], current)
        else:
            current.append((instruction.upper(), rest))
    return found


def runtime_stage(name: str = "runtime") -> Stage:
    """A stage as the image runs it: its own instructions after its parents'."""
    every = stages()
    chain: list[list[tuple[str, str]]] = []
    while name in every:
        parent, instructions = every[name]
        chain.insert(0, instructions)
        name = parent
    stage = Stage()
    for instruction, rest in (pair for instructions in chain for pair in instructions):
        if instruction == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                stage.env[key] = value
        elif instruction == "WORKDIR":
            stage.workdir = rest.strip()
        elif instruction == "ENTRYPOINT":
            stage.entrypoint = json.loads(rest)
        elif instruction == "CMD":
            stage.cmd = json.loads(rest)
        elif instruction == "HEALTHCHECK":
            stage.healthcheck = json.loads(rest[rest.index("CMD ") + 4 :])
        elif instruction == "RUN":
            stage.runs.append(rest)
    return stage


def local(argv: list[str]) -> list[str]:
    """``argv`` with the image's ``ballet-planner`` replaced by this virtualenv's."""
    assert argv[0] == "ballet-planner", argv
    return [*command(), *argv[1:]]


def test_the_image_needs_no_configuration_file() -> None:
    stage = runtime_stage()
    assert stage.entrypoint == ["ballet-planner"]
    assert stage.cmd == ["serve"]
    assert stage.healthcheck == ["ballet-planner", "health"]
    # The data directory is the working directory, made and owned by the service's user.
    data_dir = stage.env["BALLET_PLANNER__DATA_DIR"]
    assert stage.workdir == data_dir
    assert any(f"chown 10001:10001 {data_dir}" in run for run in stage.runs)
    assert "--config" not in (ROOT / "Dockerfile").read_text()


def image_environment(stage: Stage, data_dir: Path) -> dict[str, str]:
    """The image's environment on this machine: its data directory at ``data_dir`` and
    its ports (on every interface, as in the image) moved to port 0 (any free one: the
    bound ones are read from ``--ready-file``)."""
    env = dict(stage.env)
    assert env["BALLET_PLANNER__DATA_DIR"] == stage.workdir
    env["BALLET_PLANNER__DATA_DIR"] = str(data_dir)
    for key in ("BALLET_PLANNER__SERVER__ADDRESS", "BALLET_PLANNER__SERVER__METRICS_ADDRESS"):
        host, _, _ = env[key].rpartition(":")
        assert host == "0.0.0.0", f"{key}: the image listens on every interface"
        env[key] = f"{host}:0"
    return env


def deployment_environment(root: Path) -> dict[str, str]:
    """What a deployment adds: Core's key set, the service token, plaintext in the mesh
    (files mounted from a Secret, not a configuration file)."""
    public = Ed25519PrivateKey.generate().public_key()
    jwk = json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(public))
    jwk.update(kid="core-1", alg="EdDSA", use="sig")
    (root / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    (root / "page-token-keys").write_text("a-page-token-key-of-the-deployment\n")
    environment = {
        "BALLET_PLANNER__AUTH__JWKS_PATH": str(root / "jwks.json"),
        "BALLET_PLANNER__AUTH__ISSUERS": "https://core.example.internal",
        "BALLET_PLANNER__AUTH__PAGE_TOKEN_KEY_FILE": str(root / "page-token-keys"),
        "BALLET_PLANNER__SERVER__INSECURE": "true",
        "BALLET_PLANNER__SERVER__GRACE_S": "7",
    }
    # One credential per dependency, each for that dependency alone (decision 0153).
    for name in ("GATEWAY", "TRACKER", "SKILLS", "KNOWLEDGE"):
        (root / f"{name.lower()}-token").write_text(f"a-service-token-for-the-{name.lower()}\n")
        environment[f"BALLET_PLANNER__DEPENDENCIES__{name}__SERVICE_TOKEN_FILE"] = str(
            root / f"{name.lower()}-token"
        )
    return environment


def test_cmd_and_healthcheck_run_with_environment_variables_alone(tmp_path: Path) -> None:
    stage = runtime_stage()
    data_dir = tmp_path / "var-lib-ballet-planner"
    data_dir.mkdir()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    env = clean_env(**image_environment(stage, data_dir), **deployment_environment(secrets))
    with (tmp_path / "serve.log").open("w") as log:
        served = subprocess.Popen(
            [*local(stage.entrypoint + stage.cmd), "--ready-file", str(tmp_path / "ready.json")],
            cwd=data_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            bound = serve_address(tmp_path / "ready.json", served, tmp_path / "serve.log")
            address = bound.replace("0.0.0.0", "127.0.0.1")
            wait_serving(address, served, tmp_path)
            # The HEALTHCHECK asks server.address of the environment: the bound one here.
            port = address.rpartition(":")[2]
            health = subprocess.run(
                local(stage.healthcheck),
                cwd=data_dir,
                env={**env, "BALLET_PLANNER__SERVER__ADDRESS": f"0.0.0.0:{port}"},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        finally:
            served.terminate()
            served.wait(30)
    assert served.returncode == 0, (tmp_path / "serve.log").read_text()
    assert (data_dir / "planner.db").exists()  # SQLite in the writable data directory


def test_the_image_alone_refuses_dev_mode_on_every_interface(tmp_path: Path) -> None:
    stage = runtime_stage()
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    result = subprocess.run(
        local(stage.entrypoint + stage.cmd),
        cwd=data_dir,
        env=clean_env(**image_environment(stage, data_dir)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "server.address: dev mode" in result.stderr and "auth.jwks_path" in result.stderr


@pytest.mark.slow
def test_the_build_context_holds_everything_the_wheels_need(tmp_path: Path) -> None:
    # .dockerignore is an allow-list: build both wheels from exactly what it lets in, as
    # the builder stage does.
    context = tmp_path / "context"
    context.mkdir()
    allowed = [
        line[1:].strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for name in allowed:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, context / name)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("--wheel-dir", str(tmp_path / "wheels"), str(context), str(context / "devstack")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (planner,) = (tmp_path / "wheels").glob("ballet_planner-*.whl")
    names = zipfile.ZipFile(planner).namelist()
    for expected in (
        "service/cli.py",
        "service/server/root.py",
        "ballet_common/__init__.py",
        "ballet_chat/run.py",
        "ballet/planner/v1/chat_pb2.py",
    ):
        assert expected in names, expected
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    # The production wheel holds the planner alone, and pulls nothing the devstack needs.
    assert not [name for name in names if name.startswith("devstack/")]
    requires = [
        line.partition(":")[2].strip().split(";")[0]
        for line in zipfile.ZipFile(planner).read(_metadata(names)).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    for devstack_only in ("openai", "httpx", "httpx2", "pyyaml"):
        assert not [r for r in requires if r.lower().startswith(devstack_only)], requires
    (devstack,) = (tmp_path / "wheels").glob("ballet_devstack-*.whl")
    devstack_names = zipfile.ZipFile(devstack).namelist()
    for expected in ("devstack/dev.py", "devstack/command.py", "devstack/demo/scenario.json"):
        assert expected in devstack_names, expected
    assert "devstack/pyproject.toml" not in devstack_names


def _metadata(names: list[str]) -> str:
    (found,) = [name for name in names if name.endswith(".dist-info/METADATA")]
    return found


def test_the_production_image_installs_the_planner_alone_and_the_demo_adds_the_devstack() -> None:
    runtime, demo = runtime_stage(), runtime_stage("demo")
    installs = [run for run in runtime.runs if "pip install" in run]
    assert installs and all("ballet-planner" in run and "devstack" not in run for run in installs)
    assert any("ballet-devstack" in run for run in demo.runs)
    assert demo.cmd == ["dev"] and runtime.cmd == ["serve"]
