"""Real black holes for the fault suite (decision 0315): PostgreSQL in a network
namespace of its own, reached over a veth pair, and iptables DROP rules that make it
silent (no reset, no answer) as a failed host or a partition does.

Needs root (``ip netns``, iptables); ``require_root_network()`` skips the tests with the
reason, or fails them where ``BALLET_REQUIRE_FAULTS=1`` or ``CI`` says they must run
(``.ci/run`` sets it).
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import pytest

from tests.pg import PG_OS_USER, PgCluster

_TRUE = {"1", "true", "yes", "on"}


def faults_required() -> bool:
    """Whether missing root or tools must fail the fault suite instead of skipping it."""
    return any(
        os.environ.get(flag, "").strip().lower() in _TRUE
        for flag in ("CI", "BALLET_REQUIRE_FAULTS")
    )


def require_root_network() -> None:
    """Skip (or fail, in CI) unless this process may make namespaces and DROP rules."""
    missing = ""
    if os.geteuid() != 0:
        missing = "network namespaces and iptables need root"
    elif shutil.which("ip") is None or shutil.which("iptables") is None:
        missing = "ip (iproute2) and iptables are not installed"
    if missing:
        if faults_required():
            pytest.fail(f"the fault suite cannot run: {missing}")
        pytest.skip(f"the fault suite needs root and iptables: {missing}")


@contextmanager
def _subnet_lock() -> Iterator[None]:
    """An exclusive lock, across the processes of this machine, on choosing a subnet."""
    path = Path(tempfile.gettempdir()) / "ballet-faults-subnets.lock"
    with path.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


class Namespace:
    """A network namespace joined to this one by a veth pair: ``host_ip`` here,
    ``inner_ip`` inside. ``silence()`` drops every packet between them in both
    directions; ``heal()`` removes the rules."""

    def __init__(self, index: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"ballet-{tag}"
        self.outer = f"bo{tag}"
        self.inner = f"bi{tag}"
        subnet = f"10.{200 + index % 50}.{int(tag[:2], 16)}"
        self.host_ip, self.inner_ip = f"{subnet}.1", f"{subnet}.2"
        #: A second address of the inside, so that one peer can be cut alone.
        self.other_ip = f"{subnet}.3"
        self.silent = False
        self._cut: set[str] = set()

    def create(self) -> None:
        _sh("ip", "netns", "add", self.name)
        _sh("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _sh("ip", "link", "set", self.inner, "netns", self.name)
        with _subnet_lock():
            # Suites that run at once on this machine must not share a subnet: another
            # subnet when this one is on an interface already (under a lock that every
            # suite of this version takes).
            self._free_subnet()
            _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.outer)
        _sh("ip", "link", "set", self.outer, "up")
        self.run("ip", "addr", "add", f"{self.inner_ip}/24", "dev", self.inner)
        self.run("ip", "addr", "add", f"{self.other_ip}/24", "dev", self.inner)
        self.run("ip", "link", "set", self.inner, "up")
        self.run("ip", "link", "set", "lo", "up")

    def _free_subnet(self) -> None:
        used = _sh("ip", "-4", "-o", "addr", "show").stdout
        second = int(self.host_ip.split(".")[1])
        for _ in range(256):
            subnet = self.host_ip.rsplit(".", 1)[0]
            if f"inet {subnet}." not in used:
                return
            subnet = f"10.{second}.{random.randrange(256)}"
            self.host_ip, self.inner_ip = f"{subnet}.1", f"{subnet}.2"
            self.other_ip = f"{subnet}.3"
        raise RuntimeError(f"no free subnet in 10.{second}.0.0/16 for a fault namespace")

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace."""
        return _sh("ip", "netns", "exec", self.name, *argv, check=check)

    def _rules(self, action: str) -> None:
        # Inside the namespace: nothing in, nothing out; the peer sees silence.
        for chain in ("INPUT", "OUTPUT"):
            self.run(
                "iptables",
                action,
                chain,
                "-i" if chain == "INPUT" else "-o",
                self.inner,
                "-j",
                "DROP",
            )

    def silence(self) -> None:
        if not self.silent:
            self._rules("-I")
            self.silent = True

    def heal(self) -> None:
        if self.silent:
            self._rules("-D")
            self.silent = False

    def cut(self, address: str) -> None:
        """Silence the inside's ``address`` only (a partition between it and whoever uses
        it): packets to it and from it are dropped."""
        if address not in self._cut:
            self.run("iptables", "-I", "INPUT", "-d", address, "-j", "DROP")
            self.run("iptables", "-I", "OUTPUT", "-s", address, "-j", "DROP")
            self._cut.add(address)

    def mend(self, address: str) -> None:
        if address in self._cut:
            self.run("iptables", "-D", "INPUT", "-d", address, "-j", "DROP")
            self.run("iptables", "-D", "OUTPUT", "-s", address, "-j", "DROP")
            self._cut.discard(address)

    def destroy(self) -> None:
        _sh("ip", "link", "del", self.outer, check=False)
        _sh("ip", "netns", "del", self.name, check=False)


class NamespacedPg(PgCluster):
    """A throwaway PostgreSQL cluster whose postmaster runs inside ``namespace`` and
    listens on its veth address only."""

    namespace: Namespace

    def _run(
        self, argv: list[str], *, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        namespace = getattr(self, "namespace", None)
        if namespace is None or not argv or Path(argv[0]).name != "pg_ctl":
            return super()._run(argv, check=check, input_text=input_text)
        # Into the namespace as root, then down to the cluster's owner.
        argv = ["ip", "netns", "exec", namespace.name, "runuser", "-u", PG_OS_USER, "--", *argv]
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
            cwd=self.base_dir,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, argv, output=result.stdout, stderr=result.stderr
            )
        return result

    def admin_url(self) -> str:
        return f"postgresql://postgres@{self.namespace.inner_ip}:{self.port}/postgres"

    def url(self, dbname: str, address: str = "") -> str:
        """The SQLAlchemy URL of ``dbname`` at ``address`` (default: the inside's first)."""
        host = address or self.namespace.inner_ip
        return f"postgresql+psycopg://postgres@{host}:{self.port}/{dbname}"


@contextmanager
def silent_database(index: int = 0) -> Iterator[tuple[NamespacedPg, Namespace]]:
    """A running PostgreSQL in a namespace of its own, and the namespace (to silence)."""
    require_root_network()
    namespace = Namespace(index)
    namespace.create()
    base = Path(tempfile.mkdtemp(prefix="ballet-faults-"))
    try:
        # Its own namespace, so the standard port is free there.
        cluster = cast(NamespacedPg, NamespacedPg.create(base, port=5432))
        cluster.namespace = namespace
        addresses = f"{namespace.inner_ip},{namespace.other_ip}"
        cluster.configure({"listen_addresses": f"'{addresses}'"})
        cluster._run(
            ["tee", "-a", str(cluster.data_dir / "pg_hba.conf")],
            input_text=f"host all all {namespace.host_ip}/32 trust\n",
        )
        cluster.start()
        try:
            yield cluster, namespace
        finally:
            namespace.heal()
            for address in list(namespace._cut):
                namespace.mend(address)
            cluster.stop("immediate")
    finally:
        namespace.destroy()
        shutil.rmtree(base, ignore_errors=True)
