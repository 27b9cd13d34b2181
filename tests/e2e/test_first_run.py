"""First-run errors: an unusable data directory is one clear line for
``serve``, ``token``, ``dev`` and ``migrate``, never a traceback; ``token`` mints only
from a secret the planner made, unless ``--create-secret`` asks for one; every
``.ballet-*`` data directory the README creates is ignored by git."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.dev_support import clean_env
from tests.e2e.test_cli_serve import command, run

REPO = Path(__file__).resolve().parents[2]


def _unusable_dirs(root: Path) -> dict[str, str]:
    """Data directories that cannot be used, and what the error must say of each."""
    (root / "a-file").write_text("not a folder")
    (root / "secret-is-a-folder" / "dev-secret").mkdir(parents=True)
    return {
        "a-file": "data directory a-file is a file, not a folder",
        "a-file/below": "data directory a-file/below",
        "secret-is-a-folder": "data directory secret-is-a-folder: cannot ",
    }


def _one_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_serve_with_an_unusable_data_directory_says_so_in_one_line(tmp_path: Path) -> None:
    for data_dir, expected in _unusable_dirs(tmp_path).items():
        result = run(
            ["serve"],
            tmp_path,
            BALLET_PLANNER__DATA_DIR=data_dir,
            BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
            BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
        )
        assert result.returncode == 1, result.stderr
        _one_line(result, expected)
        assert "BALLET_PLANNER__DATA_DIR" in result.stderr


def test_a_data_directory_given_as_a_flag_is_named_by_the_flag(tmp_path: Path) -> None:
    # Found by a new-user trial: `serve --data-dir a-file` said to set data_dir
    # (BALLET_PLANNER__DATA_DIR), which the user had not used.
    for data_dir, expected in list(_unusable_dirs(tmp_path).items())[:2]:
        for subcommand in (["serve"], ["migrate"]):
            result = run(
                [*subcommand, "--data-dir", data_dir],
                tmp_path,
                BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
                BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
            )
            assert result.returncode == 1, result.stderr
            _one_line(result, expected)
            assert result.stderr.rstrip().endswith("give --data-dir a writable folder")


def test_migrate_with_an_unusable_data_directory_says_so_in_one_line(tmp_path: Path) -> None:
    for data_dir, expected in list(_unusable_dirs(tmp_path).items())[:2]:
        result = run(["migrate"], tmp_path, BALLET_PLANNER__DATA_DIR=data_dir)
        assert result.returncode == 1, result.stderr
        _one_line(result, expected)


def test_token_with_an_unusable_data_directory_says_so_in_one_line(tmp_path: Path) -> None:
    for data_dir, expected in _unusable_dirs(tmp_path).items():
        for extra in ([], ["--create-secret"]):
            result = run(["token", "--user", "alice", "--data-dir", data_dir, *extra], tmp_path)
            assert result.returncode == 2, result.stderr
            _one_line(result, expected)


def test_dev_with_an_unusable_data_directory_says_so_in_one_line(tmp_path: Path) -> None:
    for data_dir, expected in list(_unusable_dirs(tmp_path).items())[:2]:
        result = run(
            ["dev", "--data-dir", data_dir, "--address", "127.0.0.1:0"],
            tmp_path,
            BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
        )
        assert result.returncode == 1, result.stderr
        _one_line(result, expected)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a read-only mount of one file needs root and unshare",
)
def test_a_read_only_database_file_stops_serve_and_dev_in_one_line(tmp_path: Path) -> None:
    # Found by a new-user trial: with planner.db read-only in a writable data directory,
    # serve started, said SERVING, and failed every chat. Read-only here is a read-only
    # bind mount of the file alone (root writes any file whatever its mode).
    data = tmp_path / "data"
    migrated = run(["migrate", "--data-dir", str(data)], tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    database = data / "planner.db"
    for args in (
        ["serve"],
        ["dev", "--address", "127.0.0.1:0", "--devstack-address", "127.0.0.1:0"],
    ):
        mounted = f"mount --bind {database} {database} && mount -o remount,bind,ro {database}"
        inner = shlex.join([*command(), *args, "--data-dir", str(data)])
        result = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f"{mounted} && exec {inner}",
            ],
            cwd=tmp_path,
            env=clean_env(
                BALLET_PLANNER__SERVER__ADDRESS="127.0.0.1:0",
                BALLET_PLANNER__SERVER__METRICS_ADDRESS="",
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        # The last line says it (serve logs its dev-mode warning first).
        last = result.stderr.strip().splitlines()[-1]
        assert f"{database} is read-only for this process" in last, result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_a_read_only_data_directory_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = run(
        ["token", "--user", "alice", "--data-dir", "locked/state", "--create-secret"], tmp_path
    )
    assert result.returncode == 2
    _one_line(result, "is not writable")


def test_token_needs_create_secret_to_make_a_secret(tmp_path: Path) -> None:
    refused = run(["token", "--user", "alice", "--data-dir", "fresh"], tmp_path)
    assert refused.returncode == 2
    _one_line(refused, "no dev secret in fresh")
    assert "--create-secret" in refused.stderr
    assert not (tmp_path / "fresh").exists()
    made = run(["token", "--user", "alice", "--data-dir", "fresh", "--create-secret"], tmp_path)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "fresh" / "dev-secret").is_file()
    again = run(["token", "--user", "alice", "--data-dir", "fresh"], tmp_path)
    assert again.returncode == 0, again.stderr


def test_every_data_directory_the_readme_creates_is_ignored_by_git() -> None:
    readme = (REPO / "README.md").read_text()
    named = sorted(set(re.findall(r"\.ballet-[\w-]+", readme)))
    assert ".ballet-dev" in named and len(named) >= 2, named
    for name in named:
        probe = f"{name}/dev-secret"
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", probe], cwd=REPO, timeout=30
        )
        assert ignored.returncode == 0, f"{probe} is not ignored by git"


# --------------------------------------------------------------------------- files a new
# user hands the planner: each is one line naming it and what to do, never a traceback.


def _said(result: subprocess.CompletedProcess[str], expected: str) -> str:
    """The one line on stderr that is not a JSON log record; it must hold ``expected``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    return lines[0]


def _serve_env(data_dir: str = "data", **extra: str) -> dict[str, str]:
    return {
        "BALLET_PLANNER__DATA_DIR": data_dir,
        "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
        "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "",
        **extra,
    }


DEV = ["dev", "--data-dir", "data", "--address", "127.0.0.1:0", "--devstack-address", "127.0.0.1:0"]
_NO_METRICS = {"BALLET_PLANNER__SERVER__METRICS_ADDRESS": ""}


def test_a_configuration_file_that_is_not_utf8_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_bytes(b"\xff\xfe[planner]\n")
    for args in (["serve"], ["migrate"], ["health"], ["dev", "--data-dir", "data"]):
        result = run([*args, "--config", "bad.toml"], tmp_path, **_serve_env())
        assert result.returncode == 2, (args, result.stderr)
        _said(result, "configuration error: bad.toml: not UTF-8 text (line 1)")


def test_a_planner_db_that_is_not_a_database_stops_start_up_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir(mode=0o700)
    junk = os.urandom(4096)
    (tmp_path / "data" / "planner.db").write_bytes(junk)
    for args, env in ((["serve"], _serve_env()), (DEV, _NO_METRICS)):
        result = run(args, tmp_path, **env)
        assert result.returncode == 1, result.stderr
        line = _said(result, "cannot start: ")
        assert "planner.db is not a SQLite database" in line and "move it away" in line
        assert (tmp_path / "data" / "planner.db").read_bytes() == junk


def test_token_refuses_a_lifetime_that_is_not_finite_or_over_thirty_days(tmp_path: Path) -> None:
    for ttl in ("inf", "nan", "1e30", "2592001"):
        result = run(["token", "--user", "alice", "--data-dir", "d", "--ttl", ttl], tmp_path)
        assert result.returncode == 2, result.stderr
        _said(result, "--ttl must be a number of seconds above 0 and at most 2592000 (30 days)")
    longest = ["token", "--user", "alice", "--data-dir", "d", "--ttl", "2592000"]
    assert run([*longest, "--create-secret"], tmp_path).returncode == 0


@pytest.mark.parametrize(("secret", "held"), [(b"", "is empty"), (b"abcde", "holds 5 bytes")])
def test_a_dev_secret_too_short_to_sign_stops_token_serve_and_dev(
    tmp_path: Path, secret: bytes, held: str
) -> None:
    (tmp_path / "data").mkdir(mode=0o700)
    (tmp_path / "data" / "dev-secret").write_bytes(secret)
    expected = f"the dev secret data/dev-secret {held}, fewer than the 32"
    token = run(["token", "--user", "alice", "--data-dir", "data"], tmp_path)
    assert token.returncode == 2 and not token.stdout
    assert "delete it" in _said(token, expected)
    for args, env in ((["serve"], _serve_env()), (DEV, _NO_METRICS)):
        result = run(args, tmp_path, **env)
        assert result.returncode == 1, result.stderr
        _said(result, f"cannot start: {expected}")
        assert "InsecureKeyLength" not in result.stderr


def test_an_otlp_endpoint_that_is_not_one_is_a_configuration_error(tmp_path: Path) -> None:
    result = run(["serve"], tmp_path, **_serve_env(OTEL_EXPORTER_OTLP_ENDPOINT="not-a-url"))
    assert result.returncode == 2, result.stderr
    _said(result, "configuration error: OTEL_EXPORTER_OTLP_ENDPOINT=not-a-url: not an OTLP")


def test_a_malformed_import_names_the_import_the_file_and_the_line(tmp_path: Path) -> None:
    (tmp_path / "issues.jsonl").write_text('{"id": "bd-1", "issue_type": "task"}\n{bad\n')
    result = run([*DEV, "--tracker", "issues.jsonl", "--project", "p"], tmp_path, **_NO_METRICS)
    assert result.returncode == 1, result.stderr
    _said(
        result,
        "cannot start: the tracker import failed: issues.jsonl, line 2: not valid JSON "
        "(expecting property name enclosed in double quotes, column 2)",
    )
