"""The first use without wrong turns: every misstep a new user can take with
``ballet-planner`` (``dev``, ``chat``, ``migrate``, ``serve``, ``token``, ``health``) is one
line that points the right way, never a traceback or an API field name, and the chat
shows what it did (the session id, the model that answered, the message typed at once).

The commands run as a user runs them: subprocesses, and a pseudo-terminal for the
interactive chat and for ``dev`` on a terminal. One ``dev`` serves the module's chats;
the tests that stop a planner start their own. Waits read the output with deadlines.
"""

from __future__ import annotations

import ast
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.defaults import BUF_INSTALL
from devstack.store.access import USERS
from tests.e2e.dev_support import ANY_PORTS, DevProcess, Terminal, clean_env, command, run_cli
from tests.e2e.test_cli_serve import start_serve
from tests.ports import refused_port

PASSWORD = "s3cret-pw"


def _one_line(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """The one line on stderr that is not a JSON log record; it holds every ``expected``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, result.stderr
    for part in expected:
        assert part in lines[0], result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcess]:
    cwd = tmp_path_factory.mktemp("first-use")
    started = DevProcess.start([], cwd)
    try:
        yield started
    finally:
        code, out = started.stop()
        assert code == 0, f"dev exited with {code}:\n{out}\n{started.log()}"


# --------------------------------------------------------------------------- databases


@pytest.fixture
def down_url() -> Iterator[tuple[str, int]]:
    """A PostgreSQL URL where nothing listens (the port held, refusing connections)."""
    with refused_port() as port:
        yield f"postgresql+psycopg://bob:{PASSWORD}@127.0.0.1:{port}/planner", port


def test_dev_with_postgresql_down_is_one_line_naming_what_was_tried(
    tmp_path: Path, down_url: tuple[str, int]
) -> None:
    url, port = down_url
    result = run_cli(
        [
            "dev",
            "--database-url",
            url,
            "--address",
            "127.0.0.1:0",
            "--devstack-address",
            "127.0.0.1:0",
            "--metrics-address",
            "",
        ],
        tmp_path,
    )
    assert result.returncode == 1
    line = _one_line(
        result, f"cannot connect to postgresql://bob@127.0.0.1:{port}/planner", "--database-url"
    )
    assert "connection refused" in line
    assert PASSWORD not in result.stderr + result.stdout


def test_migrate_and_serve_with_the_database_down_say_what_was_tried(
    tmp_path: Path, down_url: tuple[str, int]
) -> None:
    url, port = down_url
    migrate = run_cli(["migrate", "--database-url", url], tmp_path)
    serve = run_cli(
        ["serve"],
        tmp_path,
        BALLET_PLANNER__DATABASE__URL=url,
        BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
    )
    # serve takes --database-url as migrate does (decision 0324), and names it.
    serve_flag = run_cli(
        ["serve", "--database-url", url],
        tmp_path,
        BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
        BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
    )
    for result, setting in (
        (migrate, "--database-url"),
        (serve, "BALLET_PLANNER__DATABASE__URL"),
        (serve_flag, "with serve: --database-url"),
    ):
        assert result.returncode == 1
        line = _one_line(result, f"postgresql://bob@127.0.0.1:{port}/planner", setting)
        assert "unreachable: the database is unavailable" not in line
        assert PASSWORD not in result.stderr


# --------------------------------------------------------------------------- chat


def test_an_unknown_dev_user_or_organization_lists_the_dev_users(dev: DevProcess) -> None:
    mallory = dev.chat("--user", "mallory", "--message", "hello")
    assert mallory.returncode == 2
    _one_line(mallory, "no dev user 'mallory'", "alice, bob", "organization acme", "--user")
    other = dev.chat("--org", "other", "--message", "hello")
    assert other.returncode == 2
    _one_line(other, "'alice' is in organization 'acme', not 'other'", "--org acme")


def test_chat_from_another_folder_shows_the_data_directory_it_looked_in(
    dev: DevProcess, tmp_path: Path
) -> None:
    result = run_cli(
        ["chat", "--address", dev.planner, "--user", "alice", "--message", "hi"], tmp_path
    )
    assert result.returncode == 2
    _one_line(result, f"no dev secret in {tmp_path / '.ballet-dev'}:", "--data-dir")
    # The banner names the folder dev uses, absolute, for that --data-dir.
    assert f"data       {dev.cwd / '.ballet-dev'} " in dev.banner


def _metric(dev: DevProcess, name: str, method: str) -> float:
    address = re.search(r"metrics (http://\S+/metrics)", dev.banner)
    assert address, dev.banner
    with urllib.request.urlopen(address.group(1), timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf'^{name}_total\{{grpc_method="{method}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_message_prints_the_session_id_the_model_that_answered_and_no_get_turn(
    dev: DevProcess,
) -> None:
    before = _metric(dev, "ballet_planner_grpc_server_started", "GetTurn")
    first = dev.chat("--message", "What are the open epics?")
    assert first.returncode == 0, first.stdout + first.stderr
    found = re.fullmatch(
        r"ballet-planner chat: session (\S+) \(continue it with --session \1\)\n", first.stderr
    )
    assert found, first.stderr
    # The scripted demo model answered, and the model line says so.
    assert "  (model scripted demo)\n" in first.stdout
    assert "gpt-4o-mini" not in first.stdout
    second = dev.chat("--session", found.group(1), "--message", "Tell me about PAN-4")
    assert second.returncode == 0, second.stdout + second.stderr
    assert found.group(1) in second.stderr
    # Each message was matched to its acceptance by its request id, never by a read.
    assert _metric(dev, "ballet_planner_grpc_server_started", "GetTurn") == before
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "`--session ID`" in readme


def _terminal_chat(dev: DevProcess, *args: str) -> Terminal:
    return Terminal(
        [*command(), "chat", "--address", dev.planner, "--user", "alice", *args],
        dev.cwd,
        clean_env(TERM="xterm"),
    )


def test_open_takes_a_sessions_row_or_an_unambiguous_id_prefix(dev: DevProcess) -> None:
    made = [dev.chat("--message", f"prefix test {n}") for n in range(2)]
    ids = [re.search(r"session (\S+) ", m.stderr).group(1) for m in made]  # type: ignore[union-attr]
    terminal = _terminal_chat(dev)
    try:
        terminal.expect(r"a new session starts with your first message", timeout=60)
        terminal.send("/sessions")
        row = terminal.expect(rf"\s+(\d+)  {ids[1]}")
        terminal.send(f"/open {row.group(1)}")
        terminal.expect(rf"session {ids[1]} in project demo")
        terminal.expect(r"prefix test 1")
        prefix = next(
            ids[0][:n] for n in range(4, len(ids[0])) if not ids[1].startswith(ids[0][:n])
        )
        terminal.send(f"/open {prefix}")
        terminal.expect(rf"session {ids[0]} in project demo")
        terminal.send("/open 99")
        terminal.expect(r"no row 99")
        terminal.send("/quit")
        assert terminal.wait() == 0
    finally:
        terminal.close()


def test_a_message_typed_before_the_chat_is_ready_is_echoed_after_the_prompt(
    dev: DevProcess,
) -> None:
    terminal = _terminal_chat(dev)
    try:
        # Typed at once, before the chat has connected, let alone opened a stream.
        terminal.send("What can I work on?")
        terminal.expect(r"a new session starts with your first message", timeout=60)
        terminal.expect(r"> What can I work on\?")
        terminal.expect(r"new session \S+ in project demo")
        terminal.expect(r"\[COMPLETED", timeout=60)
        terminal.send("/quit")
        assert terminal.wait() == 0
    finally:
        terminal.close()


def test_a_planner_that_stops_says_so_plainly_and_how_to_continue(tmp_path: Path) -> None:
    own = DevProcess.start([], tmp_path)
    terminal = Terminal(
        [*command(), "chat", "--address", own.planner, "--user", "alice"],
        tmp_path,
        clean_env(TERM="xterm"),
    )
    try:
        terminal.expect(r"a new session starts with your first message", timeout=60)
        terminal.send("What are the open epics?")
        session = terminal.expect(r"new session (\S+) in project demo").group(1)
        terminal.expect(r"\[COMPLETED", timeout=60)
        code, _ = own.stop()
        assert code == 0
        line = terminal.expect(r"ballet-planner chat: [^\n]*\n").group(0)
        assert "the planner stopped" in line, terminal.output
        assert f"rerun the same command with --session {session} to continue" in line
        assert "after_sequence" not in terminal.output
        assert terminal.wait() == 1
    finally:
        terminal.close()
        own.kill()


def test_no_api_field_names_in_what_the_chat_client_says() -> None:
    """Every sentence the chat client writes (its string literals with a space, docstrings
    aside) is free of the API's field names; the planner's own messages that speak to API
    clients are replaced by plain ones (``PLAIN_MESSAGES``)."""
    fields = ("after_sequence", "request_id", "turn_id", "session_id", "page_token")
    root = Path(__file__).resolve().parents[2] / "ballet_chat"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if id(node) in docstrings or " " not in node.value:
                continue
            for name in fields:
                assert name not in node.value, f"{path.name}:{node.lineno}: {node.value!r}"
    from ballet_chat.render import PLAIN_MESSAGES, describe_status

    said = describe_status("UNAVAILABLE", "SHUTTING_DOWN", "reopen with after_sequence")
    assert "after_sequence" not in said and PLAIN_MESSAGES["SHUTTING_DOWN"] in said


# --------------------------------------------------------------------------- dev


def test_dev_on_a_terminal_logs_text_and_keeps_start_and_call_lines_out(tmp_path: Path) -> None:
    terminal = Terminal(
        [*command(), "dev", *ANY_PORTS],
        tmp_path,
        clean_env(TERM="xterm"),
    )
    try:
        banner = terminal.expect(r"planner\s+(\S+:\d+)", timeout=60)
        terminal.expect(r"Stop with Ctrl-C\.")
        chat = run_cli(
            ["chat", "--address", banner.group(1), "--user", "alice", "--message", "hello"],
            tmp_path,
        )
        assert chat.returncode == 0, chat.stderr
        terminal.process.send_signal(signal.SIGINT)
        terminal.expect(r"ballet-planner dev: stopped")
        assert terminal.wait() == 0
    finally:
        terminal.close()
    before = terminal.output.split("ballet-planner dev: ready", 1)[0]
    assert not re.search(r"^\{", terminal.output, re.MULTILINE), terminal.output
    assert "WARNING service.server.root: dev mode" in before
    assert "Running upgrade" not in terminal.output
    assert "generate done" not in terminal.output
    # One recipe for buf: the README's, word for word.
    assert BUF_INSTALL in terminal.output.replace("\n", " ")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"`{BUF_INSTALL}`" in readme
    # The users as the devstack knows them (the same table the chat's check reads).
    for user, (org, _) in USERS.items():
        assert re.search(rf"organization {org}[:,][^\n]*\b{user} \(", terminal.output), user


def test_dev_logs_json_when_not_on_a_terminal_or_when_asked(dev: DevProcess) -> None:
    assert dev.log().startswith("{"), dev.log()
    assert "Running upgrade" not in dev.log()


def test_a_taken_port_is_one_line_naming_the_flag_and_the_variable(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        cases = {
            "--address": ["--address", address, "--metrics-address", "127.0.0.1:0"],
            "--metrics-address": ["--address", "127.0.0.1:0", "--metrics-address", address],
        }
        for flag, args in cases.items():
            result = run_cli(["dev", "--devstack-address", "127.0.0.1:0", *args], tmp_path)
            assert result.returncode == 1
            variable = "SERVER__METRICS_ADDRESS" if "metrics" in flag else "SERVER__ADDRESS"
            line = _one_line(result, address, f"with dev: {flag}", f"BALLET_PLANNER__{variable}")
            assert line.startswith("ballet-planner dev: cannot start:")
            assert "add_port" not in result.stderr
        devstack = run_cli(["dev", "--devstack-address", address], tmp_path)
        assert devstack.returncode == 1
        _one_line(devstack, address, "--devstack-address")
        assert "add_port" not in devstack.stderr
        # The standalone devstack: the same clash, the same exit code.
        alone = subprocess.run(
            [sys.executable, "-m", "devstack", "--address", address],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert alone.returncode == 1, alone.stderr
        _one_line(alone, address)


def test_a_second_dev_on_the_same_data_directory_is_refused(dev: DevProcess) -> None:
    free = ["--address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0"]
    result = run_cli(["dev", "--devstack-address", "127.0.0.1:0", *free], dev.cwd)
    assert result.returncode == 1
    line = _one_line(result, "is in use by another `ballet-planner dev`", "--data-dir")
    assert line.startswith("ballet-planner dev: cannot start:")


def test_serve_on_sqlite_is_refused_a_data_directory_a_dev_holds(dev: DevProcess) -> None:
    # SQLite is for one process (decision 0229): serve on dev's files stops before it
    # starts; on PostgreSQL the same folder is fine (its secret only).
    free = {
        "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
        "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "",
    }
    result = run_cli(["serve", "--data-dir", dev.data_dir], dev.cwd, **free)
    assert result.returncode == 1, result.stderr
    line = _one_line(result, "is in use by another `ballet-planner dev`", "--data-dir")
    assert line.startswith("ballet-planner: cannot start:")
    assert "SQLite is for one process" in line


# --------------------------------------------------------------------------- usage


def test_a_wrong_flag_prints_the_subcommands_usage(tmp_path: Path) -> None:
    for args, usage in ((["chat", "--bogus"], "chat"), (["serve", "--port", "1"], "serve")):
        result = run_cli(args, tmp_path)
        assert result.returncode == 2
        assert result.stderr.startswith(f"usage: ballet-planner {usage} "), result.stderr
        assert "unrecognized arguments" in result.stderr
    # Without a command, the unknown flag is named too, not only the missing COMMAND.
    bare = run_cli(["--bogus"], tmp_path)
    assert bare.returncode == 2
    assert "unrecognized arguments: --bogus; give a COMMAND first" in bare.stderr


def test_an_empty_session_or_message_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    # Found by a new-user trial: `chat --session ""` started a new session silently.
    for args, said in (
        (["--session", ""], "--session is empty"),
        (["--message", " "], "--message is empty"),
    ):
        # No data directory here: the arguments are checked before the dev secret.
        result = run_cli(["chat", "--user", "alice", *args], tmp_path)
        assert result.returncode == 2
        assert result.stderr.startswith(f"ballet-planner chat: {said}"), result.stderr


def test_health_of_an_unknown_service_says_which_exist(dev: DevProcess) -> None:
    result = run_cli(["health", "--address", dev.planner, "--service", "nope"], dev.cwd)
    assert result.returncode == 1
    _one_line(result, "no health service 'nope'", "ballet.planner.v1.PlannerService", "liveness")


def test_token_refuses_an_unknown_scope_with_the_known_ones(dev: DevProcess) -> None:
    result = run_cli(["token", "--user", "reports", "--scope", "bogus.scope"], dev.cwd)
    assert result.returncode == 2 and not result.stdout
    _one_line(result, "unknown scope bogus.scope", "planner.sessions.read")


def test_token_refuses_a_user_the_devstack_does_not_know(dev: DevProcess) -> None:
    result = run_cli(["token", "--user", "zzz"], dev.cwd)
    assert result.returncode == 2 and not result.stdout
    _one_line(result, "no dev user 'zzz'", "alice")
    result = run_cli(["token", "--user", "carol"], dev.cwd)
    assert result.returncode == 2 and not result.stdout
    _one_line(result, "organization 'globex'", "--org globex")
    assert run_cli(["token", "--user", "carol", "--org", "globex"], dev.cwd).returncode == 0


def test_health_with_nothing_listening_says_what_to_start(tmp_path: Path) -> None:
    with refused_port() as port:
        address = f"127.0.0.1:{port}"
        result = run_cli(["health", "--address", address, "--timeout", "2"], tmp_path)
    assert result.returncode == 1
    _one_line(result, "UNAVAILABLE", "ballet-planner dev", "--address")


def test_the_devstack_names_its_allow_non_loopback_flag(tmp_path: Path) -> None:
    result = run_cli(["dev", "--devstack-address", "0.0.0.0:0"], tmp_path)
    assert result.returncode == 1
    line = _one_line(result, "--allow-non-loopback")
    assert "allow_non_loopback" not in line


def test_the_readme_says_how_to_get_buf_where_it_shows_buf_curl() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = readme.index("buf curl")
    near = readme[first - 200 : first + 400]
    assert "npm install" in near and "@bufbuild/buf" in near


def test_what_was_tried_names_every_host_and_never_the_password() -> None:
    from ballet_common.databases import database_target

    multi = database_target(f"postgresql+psycopg://bob:{PASSWORD}@/planner?host=a:5432&host=b")
    assert multi == "postgresql://bob@a:5432,b:5432/planner"
    single = database_target(f"postgresql+psycopg://bob:{PASSWORD}@[::1]:6432/planner")
    assert single == "postgresql://bob@[::1]:6432/planner"


def test_serve_without_its_dependencies_says_what_to_start(tmp_path: Path) -> None:
    # serve said SERVING and the first chat failed "the tracker backend failed
    # (UNAVAILABLE)" with no word of what to start (decision 0324).
    with refused_port() as port:
        nowhere = f"127.0.0.1:{port}"
        env = {
            "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "",
            **{
                f"BALLET_PLANNER__DEPENDENCIES__{name}__ADDRESS": nowhere
                for name in ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY")
            },
        }
        log_path = tmp_path / "serve.log"
        served, address = start_serve(tmp_path, env)
        try:
            chat = run_cli(
                ["chat", "--address", address, "--user", "alice", "--message", "hello"], tmp_path
            )
        finally:
            served.terminate()
            served.wait(30)
    warnings = [line for line in log_path.read_text().splitlines() if "nothing answers" in line]
    assert len(warnings) == 1, log_path.read_text()
    assert nowhere in warnings[0] and "tracker, skills, knowledge, gateway" in warnings[0]
    assert "python -m devstack" in warnings[0] and "ballet-planner dev" in warnings[0]
    assert chat.returncode == 1
    line = _one_line(chat, "DEPENDENCY_UNAVAILABLE", "python -m devstack", "ballet-planner dev")
    assert "cannot reach the planner" not in line
