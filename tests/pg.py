"""Throwaway PostgreSQL servers for the tests.

Two kinds of server satisfy the same small interface (`PgServer`):

- `PgCluster`: a private PostgreSQL cluster made with ``initdb`` in a temporary folder,
  tuned for speed rather than durability, listening on loopback only. The tests own it
  completely, so they may stop and restart it to exercise recovery.
- `ExternalPg`: a server someone else runs, named by ``BALLET_TEST_DATABASE_URL``. The
  tests may create and drop databases on it, nothing more.

PostgreSQL refuses to run as root. When the tests run as root (CI does), every server
command runs as the ``postgres`` OS user through ``runuser``, and the cluster's folder is
handed to that user; its parents must be traversable by it, which is why clusters live
in a fresh ``mkdtemp`` folder rather than under pytest's root-only ``tmp_path``.

Nothing here imports pytest: the fixtures in ``tests/conftest.py`` decide whether a
missing PostgreSQL skips or fails a test.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

__all__ = [
    "ExternalPg",
    "PgCluster",
    "PgServer",
    "PostgresNotFound",
    "find_pg_bin",
    "postgres_required",
]

# The OS user that owns and runs clusters when the tests run as root.
PG_OS_USER = "postgres"
# A cluster that starts slower than this is broken, not slow (a cold start takes ~1 s).
START_TIMEOUT_S = 60
# Truthy spellings of an environment flag; anything else (unset, "", "0", "false") is off.
_TRUE = {"1", "true", "yes", "on"}


class PostgresNotFound(RuntimeError):
    """The PostgreSQL server binaries (initdb, pg_ctl) are not installed."""


def postgres_required() -> bool:
    """Whether a missing PostgreSQL must fail the tests instead of skipping them.

    True in CI (``CI`` set to a truthy value, as CI services do) or when
    ``BALLET_REQUIRE_POSTGRES=1``: there a skip would hide that the database tests never
    ran.
    """
    return any(
        os.environ.get(flag, "").strip().lower() in _TRUE
        for flag in ("CI", "BALLET_REQUIRE_POSTGRES")
    )


def find_pg_bin(name: str) -> Path | None:
    """Locate a PostgreSQL server program such as ``initdb`` or ``pg_ctl``.

    Looks on ``PATH`` first, then under ``/usr/lib/postgresql/<major>/bin`` (where Debian
    and Ubuntu install the server without putting it on ``PATH``), newest major first.
    Returns None when it is nowhere.
    """
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)

    def major(path: str) -> int:
        match = re.search(r"/postgresql/(\d+)/", path)
        return int(match.group(1)) if match else -1

    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=major, reverse=True)
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def _require_bin(name: str) -> Path:
    path = find_pg_bin(name)
    if path is None:
        raise PostgresNotFound(
            f"PostgreSQL server program {name!r} not found on PATH nor under "
            "/usr/lib/postgresql/*/bin: install PostgreSQL 15 (Debian: apt-get install "
            "postgresql), or point BALLET_TEST_DATABASE_URL at a running server"
        )
    return path


def _reserve_loopback_port() -> socket.socket:
    """A loopback TCP port held for PostgreSQL, which must be told its port and cannot be
    handed a socket: a socket bound to port 0 with SO_REUSEADDR that never listens. Until
    it is closed nobody else can bind the port (a plain bind is refused, and the kernel
    hands it to no other bind to port 0), while PostgreSQL, which binds with SO_REUSEADDR,
    can: so the port is never free between its choice and PostgreSQL's bind (decision
    0322). ``PgCluster.start`` closes it once the server listens."""
    reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.bind(("127.0.0.1", 0))
    return reservation


class PgServer:
    """What the tests may do with any PostgreSQL server: make and drop databases."""

    def admin_url(self) -> str:
        """A libpq URL (``postgresql://...``) of the maintenance database, for psycopg."""
        raise NotImplementedError

    def url(self, dbname: str) -> str:
        """The SQLAlchemy URL (``postgresql+psycopg://...``) of database `dbname`."""
        raise NotImplementedError

    def create_database(self, name: str) -> None:
        """Create an empty database `name` (raises psycopg.errors.DuplicateDatabase)."""
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop_database(self, name: str) -> None:
        """Drop database `name` if it exists, ending any sessions still connected to it.

        FORCE because a test that fails mid-way may leave pooled connections open, and a
        plain DROP would then fail the teardown and hide the real error.
        """
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


class ExternalPg(PgServer):
    """A PostgreSQL server run by someone else, given by a URL.

    The URL may be a libpq URL (``postgresql://user:pw@host:port/db``) or a SQLAlchemy
    one (``postgresql+psycopg://...``). Its database, ``postgres`` when it names none, is
    the one administrative statements connect to. The role needs CREATEDB.
    """

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        if parsed.get_backend_name() != "postgresql":
            raise ValueError(f"not a PostgreSQL URL: {parsed!r}")
        self._url = parsed.set(database=parsed.database or "postgres")

    def admin_url(self) -> str:
        return self._url.set(drivername="postgresql").render_as_string(hide_password=False)

    def url(self, dbname: str) -> str:
        return self._url.set(drivername="postgresql+psycopg", database=dbname).render_as_string(
            hide_password=False
        )


class PgCluster(PgServer):
    """A private, disposable PostgreSQL cluster for tests.

    Layout under `base_dir`: ``data/`` (the cluster, which also holds the unix socket, so
    nothing is written to /var/run/postgresql) and ``postgres.log`` (the server log, the
    first place to look when a start fails).

    Tuned for speed, not durability: fsync, synchronous_commit and full_page_writes are
    off. A "smart" or "fast" stop keeps everything committed; an "immediate" stop (a
    crash, to PostgreSQL) may lose the last fraction of a second of commits unless the
    session committed with ``SET synchronous_commit = on``. It accepts at most 300
    connections, enough for several connection pools at once, and trusts every local and
    loopback connection as any role.
    """

    def __init__(
        self, base_dir: Path, port: int | None = None, *, auto_port: bool = False
    ) -> None:
        """``port`` None: a port of the kernel's choice, held for the server until its
        first start (``_reserve_loopback_port``)."""
        self.base_dir = base_dir
        self.data_dir = base_dir / "data"
        self.log_file = base_dir / "postgres.log"
        self._reservation = _reserve_loopback_port() if port is None else None
        self.port: int = port if port is not None else self._reservation.getsockname()[1]
        self._auto_port = auto_port or port is None
        self._started_once = False
        self._pg_ctl = _require_bin("pg_ctl")
        # pg_ctl starts the postmaster as a daemon, so a test run that dies without its
        # teardown would leave servers running; stop them when the interpreter exits.
        atexit.register(self._stop_at_exit)

    @classmethod
    def create(cls, base_dir: Path, port: int | None = None) -> PgCluster:
        """Run initdb in `base_dir` (created if missing) and configure the cluster.

        `port` is the loopback TCP port; None picks a free one. The cluster is left
        stopped. Raises PostgresNotFound when the server binaries are not installed, and
        subprocess.CalledProcessError (with initdb's output) when initdb fails.
        """
        initdb = _require_bin("initdb")
        cluster = cls(base_dir, port)
        base_dir.mkdir(parents=True, exist_ok=True)
        if _as_root():
            shutil.chown(base_dir, user=PG_OS_USER, group=PG_OS_USER)
            if cluster._run(["test", "-w", str(base_dir)], check=False).returncode != 0:
                raise PermissionError(
                    f"the {PG_OS_USER} user cannot write {base_dir}: a parent folder is "
                    "not traversable by it (put the cluster under /tmp)"
                )
        cluster._run(
            [
                str(initdb),
                "--pgdata",
                str(cluster.data_dir),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                # C collation: the same sort order on every machine, whatever its locales.
                "--no-locale",
                # Durability of a throwaway cluster's files is worthless; skipping the
                # fsync of ~40 MB makes initdb several times faster.
                "--no-sync",
            ]
        )
        cluster._write_config()
        return cluster

    @classmethod
    def temporary(cls) -> PgCluster:
        """Create a stopped cluster in a new temporary folder that destroy() removes."""
        # Checked before mkdtemp so a missing PostgreSQL leaves no folder behind.
        _require_bin("initdb")
        _require_bin("pg_ctl")
        base_dir = Path(tempfile.mkdtemp(prefix="ballet-pg-"))
        try:
            return cls.create(base_dir)
        except BaseException:
            shutil.rmtree(base_dir, ignore_errors=True)
            raise

    def configure(self, settings: dict[str, str]) -> None:
        """Append ``settings`` (name -> value as postgresql.conf spells it, quotes
        included) to the configuration; call before ``start`` (e.g. the benchmark's
        ``shared_preload_libraries``)."""
        self._append_config(settings)

    def enable_replication(self) -> None:
        """Make this cluster a durable primary that streaming standbys may copy and follow
        (``standby``): fsync, full-page writes and synchronous commit on, replication
        connections trusted on loopback. Call before ``start``; ``make_synchronous``
        once a standby streams."""
        self._append_config(
            {
                "fsync": "on",
                "full_page_writes": "on",
                "synchronous_commit": "on",
                "wal_level": "replica",
                "max_wal_senders": "5",
            }
        )
        self._run(
            ["tee", "-a", str(self.data_dir / "pg_hba.conf")],
            input_text="host replication all 127.0.0.1/32 trust\n",
        )

    def make_synchronous(self) -> None:
        """From now on every commit of this running primary waits until a standby has
        flushed it (``synchronous_standby_names = '*'``; before a standby streams, every
        commit would wait)."""
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")

    def standby(self) -> PgCluster:
        """A streaming standby of this running primary (``enable_replication``) in a new
        temporary folder, copied with ``pg_basebackup -R`` over loopback and left
        stopped, on a port of its own; ``destroy`` removes it. Promoted
        (``promote``), it waits for no standby of its own."""
        basebackup = _require_bin("pg_basebackup")
        base_dir = Path(tempfile.mkdtemp(prefix="ballet-pg-standby-"))
        try:
            if _as_root():
                shutil.chown(base_dir, user=PG_OS_USER, group=PG_OS_USER)
            standby = PgCluster(base_dir)
            standby._run(
                [
                    str(basebackup),
                    "--pgdata",
                    str(standby.data_dir),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--username",
                    "postgres",
                    "--write-recovery-conf",
                    "--wal-method",
                    "stream",
                    "--checkpoint",
                    "fast",
                    # The copy's own files need no fsync before the standby starts: what
                    # the test relies on is what the standby flushed while streaming.
                    "--no-sync",
                ]
            )
            standby._append_config(
                {
                    "port": str(standby.port),
                    "unix_socket_directories": f"'{standby.data_dir}'",
                    "synchronous_standby_names": "''",
                    "hot_standby": "on",
                }
            )
            return standby
        except BaseException:
            shutil.rmtree(base_dir, ignore_errors=True)
            raise

    def promote(self) -> None:
        """Promote this standby to a primary and wait until it accepts writes."""
        self._run(
            [
                str(self._pg_ctl),
                "promote",
                "--pgdata",
                str(self.data_dir),
                "--wait",
                "--timeout",
                str(START_TIMEOUT_S),
            ]
        )

    def _write_config(self) -> None:
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.data_dir}'",
            "max_connections": "300",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            # The server log goes to postgres.log via pg_ctl -l; no collector process.
            "logging_collector": "off",
        }
        self._append_config(settings)
        hba = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "host all all ::1/128 trust",
        ]
        self._run(["tee", str(self.data_dir / "pg_hba.conf")], input_text="\n".join(hba) + "\n")

    def _append_config(self, settings: dict[str, str]) -> None:
        conf = "".join(f"{key} = {value}\n" for key, value in settings.items())
        # Written through the postgres user so the files keep their owner.
        self._run(["tee", "-a", str(self.data_dir / "postgresql.conf")], input_text=conf)

    def _set_port(self, port: int) -> None:
        # The last setting in postgresql.conf wins, so appending overrides the old port.
        self.port = port
        self._run(
            ["tee", "-a", str(self.data_dir / "postgresql.conf")], input_text=f"port = {port}\n"
        )

    def start(self) -> None:
        """Start the server and wait until it accepts connections.

        Works again after stop(), on the same port. Raises RuntimeError with the tail of
        the server log when the server does not come up.
        """
        attempts = 3 if self._auto_port and not self._started_once else 1
        for attempt in range(attempts):
            result = self._run(
                [
                    str(self._pg_ctl),
                    "start",
                    "--pgdata",
                    str(self.data_dir),
                    "--log",
                    str(self.log_file),
                    "--wait",
                    "--timeout",
                    str(START_TIMEOUT_S),
                ],
                check=False,
            )
            if result.returncode == 0:
                self._started_once = True
                self._release_reservation()
                return
            log = self._log_tail()
            # Someone binding with SO_REUSEADDR too took the reserved port: another one.
            if "could not bind" in log and attempt + 1 < attempts:
                self._release_reservation()
                self._reservation = _reserve_loopback_port()
                self._set_port(self._reservation.getsockname()[1])
                continue
            raise RuntimeError(
                f"PostgreSQL did not start in {self.data_dir} (port {self.port}):\n"
                f"{result.stdout}{result.stderr}\n--- server log tail ---\n{log}"
            )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server and wait until it has exited.

        `mode` is pg_ctl's: "smart" waits for clients to leave, "fast" disconnects them
        and shuts down cleanly, "immediate" aborts (the next start runs crash recovery).
        Does nothing when the server is not running.
        """
        if not self.is_running():
            return
        self._run(
            [str(self._pg_ctl), "stop", "--pgdata", str(self.data_dir), "--mode", mode, "--wait"]
        )

    def is_running(self) -> bool:
        """Whether the server's postmaster is alive (it may still be starting up)."""
        if not self.data_dir.exists():
            return False
        # pg_ctl status: 0 running, 3 not running, 4 no usable data directory.
        result = self._run(
            [str(self._pg_ctl), "status", "--pgdata", str(self.data_dir)], check=False
        )
        return result.returncode == 0

    def _release_reservation(self) -> None:
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    def destroy(self) -> None:
        """Stop the server at once and delete `base_dir` with everything in it."""
        self._release_reservation()
        with contextlib.suppress(Exception):
            self.stop(mode="immediate")
        shutil.rmtree(self.base_dir, ignore_errors=True)
        atexit.unregister(self._stop_at_exit)

    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, dbname: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    def _stop_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(mode="immediate")

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def _run(
        self, argv: list[str], *, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command as the cluster's owner: `postgres` when we are root, else us."""
        if _as_root():
            argv = ["runuser", "-u", PG_OS_USER, "--", *argv]
        result = subprocess.run(
            argv,
            input=input_text,
            capture_output=True,
            text=True,
            # Never read the test runner's stdin (CI has none; a terminal would block).
            stdin=None if input_text is not None else subprocess.DEVNULL,
            check=False,
            # Outside the postgres user's reach (e.g. a root-only cwd) initdb and pg_ctl
            # complain that they cannot change back to the current directory.
            cwd=self.base_dir if self.base_dir.exists() else "/",
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, argv, output=result.stdout, stderr=result.stderr
            )
        return result


def _as_root() -> bool:
    return os.geteuid() == 0
