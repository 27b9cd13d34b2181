"""Black holes on loopback (decision 0315): iptables DROP rules on this host's ``lo`` for
one TCP connection or one listening port, so that a peer on this machine vanishes
without a reset or an answer, as a client whose host died or a backend behind a
partition does.

Used where the peer cannot move into a network namespace of its own: a planner in dev
mode serves on loopback only, so its clients and its devstack are on loopback too. The
rules live in this host's namespace, so they are narrow: one connection (both ports) or
one port this process listens on (the kernel gives no other socket a port in use by a
listener), on 127.0.0.1 only, each tagged with this process's id. ``LoopbackHole``
removes its rules when it closes; rules left by a test process that died are removed
by the next one (their tag names a process that is gone).

Needs root and iptables, as the rest of the suite (``net.require_root_network``).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from tests.faults.net import require_root_network

LOOPBACK = "127.0.0.1"
_TAG = "ballet-faults-pid-"
_TAGGED = re.compile(rf'--comment "?{_TAG}(\d+)"?')


def _iptables(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # -w: wait for the xtables lock (other suites on this machine change rules too).
    return subprocess.run(["iptables", "-w", *argv], capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_rules() -> int:
    """Delete the ``INPUT`` rules tagged by test processes that no longer run; returns how
    many were deleted."""
    removed = 0
    for line in _iptables("-S", "INPUT").stdout.splitlines():
        found = _TAGGED.search(line)
        if found is None or _alive(int(found.group(1))):
            continue
        # "-A INPUT ..." lists a rule; "-D INPUT ..." with the same words deletes it.
        argv = line.replace('"', "").split()
        if argv[:2] == ["-A", "INPUT"]:
            _iptables("-D", *argv[1:], check=False)
            removed += 1
    return removed


def local_ports(server_port: int) -> set[int]:
    """The local ports of this host's established TCP connections to
    ``127.0.0.1:server_port`` (read with ``ss``; gRPC's sockets are dual-stack, listed as
    ``[::ffff:127.0.0.1]:port``, their packets IPv4)."""
    listed = subprocess.run(
        ["ss", "-Htn", "state", "established", "dst", f"{LOOPBACK}:{server_port}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ports: set[int] = set()
    for line in listed.splitlines():
        # Receive queue, send queue, local address, peer address.
        local = line.split()[2]
        ports.add(int(local.rsplit(":", 1)[1]))
    return ports


def unacknowledged(port: int) -> int:
    """Segments sent and not yet acknowledged, summed over this host's TCP
    connections from or to ``127.0.0.1:port`` (``ss -i``'s ``unacked``): 0 once every
    connection of a port that was silenced has caught up after the heal."""
    listed = subprocess.run(
        ["ss", "-Htin", f"( sport = :{port} or dport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(n) for n in re.findall(r"\bunacked:(\d+)", listed))


class LoopbackHole:
    """DROP rules on ``lo``; ``close`` (or leaving ``loopback_hole``) removes them all."""

    def __init__(self) -> None:
        self._rules: list[tuple[str, ...]] = []
        self._tag = f"{_TAG}{os.getpid()}"

    def _insert(self, *match: str) -> None:
        rule = (
            "INPUT", "-i", "lo", "-p", "tcp", *match,
            "-m", "comment", "--comment", self._tag, "-j", "DROP",
        )  # fmt: skip
        _iptables("-I", *rule)
        self._rules.append(rule)

    def drop_connection(self, client_port: int, server_port: int) -> None:
        """Silence one connection ``127.0.0.1:client_port`` <-> ``127.0.0.1:server_port``:
        its packets are dropped both ways (a client that vanished)."""
        self._insert("-s", LOOPBACK, "--sport", str(client_port), "--dport", str(server_port))
        self._insert("-d", LOOPBACK, "--sport", str(server_port), "--dport", str(client_port))

    def drop_port(self, port: int) -> None:
        """Silence every connection to and from ``127.0.0.1:port``, a port this process
        listens on (a backend behind a partition): new ones too (their SYN is dropped)."""
        self._insert("-d", LOOPBACK, "--dport", str(port))
        self._insert("-s", LOOPBACK, "--sport", str(port))

    def heal(self) -> None:
        """Remove every rule this hole inserted."""
        while self._rules:
            _iptables("-D", *self._rules.pop(), check=False)


@contextmanager
def loopback_hole() -> Iterator[LoopbackHole]:
    """A ``LoopbackHole`` whose rules are removed on the way out, whatever happens."""
    require_root_network()
    remove_stale_rules()
    hole = LoopbackHole()
    try:
        yield hole
    finally:
        hole.heal()
