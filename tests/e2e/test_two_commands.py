"""The README's two commands, run from a clone as a new user runs them
(docs/decisions/0320-two-commands.md, 0323-the-readme-commands-tested.md).

``scripts/try`` with a piped question, from a ``git clone`` of this repository (its
committed tree: what a user gets), answers it and stops ``dev``. Two ways:

- with this environment's virtualenv (``BALLET_VENV``), whose install stamp matches the
  clone's ``pyproject.toml`` files, so ``scripts/setup.py`` installs nothing: seconds. It
  proves the command's path (Python found, setup reused, dev started on the ports it
  reports, the chat answered, dev stopped) without a second install of everything;
- ``slow``: into a new virtualenv, with nothing installed before, as the README's first
  command promises (about 30 s with a warm package cache).

The ports are the only difference from the README's line: ``--address 127.0.0.1:0`` and
the two others, passed on to ``dev``, so that nothing else on the machine can clash.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.dev_support import ANY_PORTS, REPO, Terminal, clean_env

QUESTION = "What are the open epics?\n"


def clone(tmp_path: Path) -> Path:
    """A fresh clone of this repository's committed tree."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout, or no git: nothing to clone")
    target = tmp_path / "clone"
    subprocess.run(
        ["git", "clone", "--quiet", str(REPO), str(target)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return target


def run_try(
    checkout: Path, venv: Path, timeout: float, *args: str
) -> subprocess.CompletedProcess[str]:
    """``scripts/try ARGS`` on free ports with the question piped in, to its end."""
    # TMPDIR: a log that scripts/try keeps (dev failed) stays in the test's folder.
    return subprocess.run(
        ["scripts/try", *ANY_PORTS, *args],
        cwd=checkout,
        input=QUESTION,
        env=clean_env(BALLET_VENV=str(venv), TMPDIR=str(checkout.parent)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def try_in_a_terminal(checkout: Path, venv: Path, *, controlling: bool = False) -> Terminal:
    """``scripts/try`` on free ports in a pseudo-terminal (``Terminal``)."""
    return Terminal(
        [str(checkout / "scripts/try"), *ANY_PORTS],
        checkout,
        clean_env(BALLET_VENV=str(venv), TMPDIR=str(checkout.parent), TERM="xterm"),
        controlling=controlling,
    )


def assert_answered(result: subprocess.CompletedProcess[str], checkout: Path) -> None:
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    # The transcript on stdout: the tool call and the open epics of the demo project.
    assert "-> list_items" in result.stdout and "PAN-4" in result.stdout, said
    assert "[COMPLETED" in result.stdout, said
    assert '{"items"' not in result.stdout  # a readable answer, not the tool's JSON
    # The README's sample of the tool lines is what the chat printed.
    readme = (REPO / "README.md").read_text()
    sample = readme.split("```text\n", 1)[1].split("```", 1)[0]
    assert sample in result.stdout, sample
    # Its own lines on stderr: dev ran in the clone's folder and stopped.
    assert f"data {checkout / '.ballet-dev'}" in result.stderr, said
    assert result.stderr.rstrip().endswith("scripts/try: dev: stopped"), said
    assert "Traceback" not in said


def stamped_venv(checkout: Path) -> Path:
    """This test run's virtualenv, when ``scripts/setup.py`` of ``checkout`` would find it
    set up (its stamp matches the clone's pyproject files); skips otherwise (fails in CI),
    since ``scripts/try`` would then install the clone into it."""
    venv = Path(sys.prefix)
    stamp = venv / "ballet-setup.json"
    # The clone's recipe, for its key of its pyproject files.
    spec = importlib.util.spec_from_file_location("clone_setup", checkout / "scripts/setup.py")
    assert spec is not None and spec.loader is not None
    clone_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clone_setup)
    recorded = json.loads(stamp.read_text()) if stamp.exists() else {}
    if clone_setup.key() not in recorded.values():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{venv} has no install stamp of scripts/setup.py")
        pytest.skip(f"{venv} was not set up by scripts/setup.py (run scripts/test)")
    return venv


def test_try_from_a_clone_answers_a_piped_question(tmp_path: Path) -> None:
    checkout = clone(tmp_path)
    venv = stamped_venv(checkout)
    assert_answered(run_try(checkout, venv, timeout=120), checkout)


def test_try_chats_as_the_user_it_is_given(tmp_path: Path) -> None:
    checkout = clone(tmp_path)
    venv = stamped_venv(checkout)
    result = run_try(checkout, venv, 120, "--user", "bob")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "scripts/try: chatting as bob about project demo" in result.stderr
    assert "PAN-4" in result.stdout  # bob may read the tracker


def test_try_in_a_terminal_chats_and_stops_dev_when_the_chat_ends(tmp_path: Path) -> None:
    checkout = clone(tmp_path)
    venv = stamped_venv(checkout)
    terminal = try_in_a_terminal(checkout, venv)
    try:
        terminal.expect(r"chatting as alice about project demo", timeout=120)
        terminal.expect(r"> ")
        terminal.send("What are the open epics?")
        terminal.expect(r"PAN-4: Pantry inventory")
        terminal.expect(r"\[COMPLETED: 1 round\]")
        terminal.send("/quit")
        terminal.expect(r"scripts/try: dev: stopped")
        assert terminal.wait() == 0
    finally:
        terminal.close()
    assert "Traceback" not in terminal.output


def test_try_stops_dev_when_its_terminal_window_closes(tmp_path: Path) -> None:
    # Closing the window left dev running, holding its ports and the data directory:
    # the next scripts/try failed "in use". Its stop wrote to the closed terminal first,
    # which raised, so dev was never told.
    checkout = clone(tmp_path)
    venv = stamped_venv(checkout)
    terminal = try_in_a_terminal(checkout, venv, controlling=True)
    try:
        terminal.expect(r"chatting as alice about project demo", timeout=120)
        terminal.expect(r"> ")
        terminal.hang_up()
        terminal.process.wait(40)
        lock = checkout / ".ballet-dev" / "planner.lock"
        deadline = time.monotonic() + 40
        with lock.open("a") as handle:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break  # dev let the data directory go: it stopped
                except OSError:
                    assert time.monotonic() < deadline, "dev still holds the data directory"
                    time.sleep(0.1)
    finally:
        terminal.close()


def test_try_on_a_taken_port_says_how_to_take_free_ones(tmp_path: Path) -> None:
    checkout = clone(tmp_path)
    venv = stamped_venv(checkout)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run_try(checkout, venv, 120, "--address", address)  # the last one wins
    assert result.returncode == 1, result.stderr
    assert f"server.address {address} is in use" in result.stderr
    assert "`scripts/try --address 127.0.0.1:0 " in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


@pytest.mark.slow
def test_try_from_a_clone_installs_everything_it_needs(tmp_path: Path) -> None:
    checkout = clone(tmp_path)
    venv = tmp_path / "venv"
    result = run_try(checkout, venv, timeout=600)
    assert_answered(result, checkout)
    assert "setup: creating the virtualenv" in result.stderr
    again = run_try(checkout, venv, timeout=120)
    assert_answered(again, checkout)
    assert "setup:" not in again.stderr  # the rerun installs nothing


def test_try_gives_session_and_user_to_the_chat_and_the_rest_to_dev() -> None:
    """The chat's hints say "see the session with --session ID": scripts/try takes that
    argument for its chat, and ``--user NAME`` (who the chat is), and passes every other
    to ``dev``."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("try_script", REPO / "scripts/try.py")
        assert spec is not None and spec.loader is not None
        try_script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(try_script)
    finally:
        sys.path.remove(str(REPO / "scripts"))
    argv = ["--address", "127.0.0.1:0", "--session", "s-1", "--provider", "openai"]
    assert try_script.chat_arguments(argv) == (
        ["--address", "127.0.0.1:0", "--provider", "openai"],
        ["--session", "s-1"],
        None,
    )
    assert try_script.chat_arguments(["--session=s-2"]) == ([], ["--session=s-2"], None)
    assert try_script.chat_arguments(["--user", "bob", "-v"]) == (["-v"], [], "bob")
    assert try_script.chat_arguments(["--user=carol"]) == ([], [], "carol")


def test_try_refuses_a_session_or_user_without_its_value_before_installing_anything() -> None:
    for argv, said in [
        (["--session"], "--session needs a session id"),
        (["--session="], "--session needs a session id"),
        (["--session", " "], "--session needs a session id"),
        (["--user"], "--user needs a dev user's name"),
        (["--user="], "--user needs a dev user's name"),
    ]:
        refused = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "try.py"), *argv],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith(f"scripts/try: {said}"), refused.stderr


def test_try_help_reads_as_plain_text() -> None:
    shown = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "try.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert shown.stdout.startswith("scripts/try: from a fresh clone to a chat")
    assert "``" not in shown.stdout  # the docstring's markup is not shown
