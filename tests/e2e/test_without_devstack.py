"""An image without the devstack: ``ballet-planner serve`` starts and answers health, and
``dev`` says plainly that it is missing (docs/decisions/0160-devstack-split.md).

The devstack is blocked from import in the subprocess (``sys.modules["devstack"] =
None`` makes every ``import devstack...`` fail), as if the package had been left out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.e2e.test_cli_serve import clean_env, serve_address, wait_serving

#: Runs ``ballet-planner ARGS`` with the devstack missing.
WITHOUT_DEVSTACK = (
    "import sys; sys.modules['devstack'] = None; "
    "from service.cli import main; sys.exit(main(sys.argv[1:]))"
)


def planner_without_devstack(*args: str) -> list[str]:
    return [sys.executable, "-c", WITHOUT_DEVSTACK, *args]


def test_the_block_works() -> None:
    blocked = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['devstack'] = None; import devstack.dev"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr


def test_serve_answers_health_without_the_devstack(tmp_path: Path) -> None:
    env = clean_env(
        BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
        BALLET_PLANNER__SERVER__GRACE_S="7",
    )
    with (tmp_path / "serve.log").open("w") as log:
        process = subprocess.Popen(
            planner_without_devstack("serve", "--ready-file", "ready.json"),
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            address = serve_address(tmp_path / "ready.json", process, tmp_path / "serve.log")
            wait_serving(address, process, tmp_path)
            health = subprocess.run(
                planner_without_devstack("health", "--address", address),
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        finally:
            process.terminate()
            process.wait(30)
    assert process.returncode == 0, (tmp_path / "serve.log").read_text()


def test_dev_says_the_devstack_is_missing(tmp_path: Path) -> None:
    dev = subprocess.run(
        planner_without_devstack("dev"),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dev.returncode == 2
    assert dev.stderr.strip().splitlines() == [
        "ballet-planner dev: the devstack is not installed here (a production image leaves "
        "it out); from a checkout of the repository: pip install ./devstack"
    ]
