"""The standalone devstack: ``python -m devstack`` serves the LLM gateway too,
so a ``ballet-planner serve`` pointed at it answers a chat message; its banner's
``serve``, ``token`` and ``chat`` lines work as printed (ports aside: the test binds free
ones, the README's path uses the defaults)."""

from __future__ import annotations

import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.dev_support import READY_LINE, clean_env, command
from tests.e2e.test_cli_serve import start_serve, wait_serving


def read_banner(process: subprocess.Popen[str], limit_s: float = 60) -> str:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    printed = b""
    deadline = time.monotonic() + limit_s
    while READY_LINE.encode() not in printed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"no banner in time:\n{printed.decode()}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                pytest.fail(f"python -m devstack exited:\n{printed.decode()}")
            printed += data
    return printed.decode()


def printed_command(banner: str, program: str, *words: str) -> list[str]:
    """The banner's line that runs ``program`` with ``words``, split as a shell would."""
    for line in banner.splitlines():
        argv = shlex.split(line)
        names = [a for a in argv if "=" not in a]
        if names[:1] == [program] and all(word in names for word in words):
            return argv
    raise AssertionError(f"no {program} {' '.join(words)} line in:\n{banner}")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "devstack", "--address", "127.0.0.1:0", "--data-dir", "data"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "devstack.log").open("w"),
        text=True,
    )
    try:
        yield process, read_banner(process)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            if process.poll() is None:
                process.kill()


def test_serve_pointed_at_the_standalone_devstack_answers_a_chat_message(
    stack: tuple[subprocess.Popen[str], str], tmp_path: Path
) -> None:
    _, banner = stack
    assert "ballet.llm.v1.GatewayService" in banner
    assert "python -c" not in banner

    serve_line = printed_command(banner, "ballet-planner", "serve")
    env = dict(word.split("=", 1) for word in serve_line if "=" in word)
    assert env["BALLET_PLANNER__DATA_DIR"] == "data"
    # The turns name the model that answers, as under dev (decision 0272).
    assert env["BALLET_PLANNER__PLANNER__MODEL"] == "scripted demo"
    env.update(
        BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0", BALLET_PLANNER__SERVER__METRICS_ADDRESS=""
    )
    served, address = start_serve(tmp_path, env)
    try:
        wait_serving(address, served, tmp_path)
        token_line = printed_command(banner, "ballet-planner", "token", "alice")
        token = subprocess.run(
            [*command(), *token_line[1:]],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert token.returncode == 0 and token.stdout.count(".") == 2, token.stderr
        chat_line = printed_command(banner, "ballet-planner", "chat")
        chat = subprocess.run(
            [
                *command(),
                *chat_line[1:],
                *("--address", address, "--message", "What are the open epics?"),
            ],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert chat.returncode == 0, chat.stdout + chat.stderr
        assert "-> list_items" in chat.stdout and "PAN-4" in chat.stdout
        assert "(model scripted demo)" in chat.stdout, chat.stdout
    finally:
        served.terminate()
        served.wait(30)


def devstack_that_fails(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m devstack ARGS`` in ``tmp_path``, to its end (a start that fails)."""
    return subprocess.run(
        [sys.executable, "-m", "devstack", *args],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_bad_scenario_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"rules": [{"reply": {"txt": "typo"}}]}')
    result = devstack_that_fails(tmp_path, "--address", "127.0.0.1:0", "--scenario", "bad.json")
    assert result.returncode == 1  # as `ballet-planner dev` for the same problem
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m devstack: cannot start: --scenario")
    assert not (tmp_path / ".ballet-dev").exists()


def test_two_ctrl_c_stop_the_devstack_without_a_traceback(
    stack: tuple[subprocess.Popen[str], str], tmp_path: Path
) -> None:
    process, _ = stack
    assert process.stdout is not None
    process.send_signal(signal.SIGINT)
    # The banner's last newline may not have been read with it.
    line = process.stdout.readline()
    while line.strip() == "":
        assert line, "python -m devstack ended without saying it stops"
        line = process.stdout.readline()
    assert "stopping" in line
    process.send_signal(signal.SIGINT)
    code = process.wait(30)
    # 130 when the second Ctrl-C hurried the stop; 0 when the stop had ended first.
    assert code in (0, 130)
    log = (tmp_path / "devstack.log").read_text()
    assert "Traceback" not in log and "Segmentation fault" not in log


def test_an_address_in_use_says_which_flag_moves_it(tmp_path: Path) -> None:
    # Bound to port 0 and kept listening: the port is held, no pick-and-close.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        result = devstack_that_fails(tmp_path, "--address", address, "--data-dir", "data")
    assert result.returncode == 1  # as `ballet-planner dev` for the same problem
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"python -m devstack: cannot start: {address} is in use")
    assert lines[0].endswith("; choose another with --address")
