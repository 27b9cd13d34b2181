"""Whether an address stays on this machine: the one test the planner's settings, its
outbound channels, the chat client and the devstack all apply (decision 0332); and the
one reading of a ``host:port`` they bind."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """True when ``address`` stays on this machine: ``localhost``, a loopback IP
    (127.0.0.0/8, ``::1``) with or without a port and a gRPC name scheme, or a Unix
    socket. Any other name is not, even if it resolves to loopback: resolution may
    change, the configuration does not."""
    target = address.strip()
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    # ``ipv4:`` and ``ipv6:`` targets may list several addresses; all must be local.
    return all(_loopback_host(_host(part)) for part in target.split(","))


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as its host (brackets removed) and port
    (0-65535; 0: any free port). Raises ``ValueError`` for anything else."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port_text)


def _loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host(target: str) -> str:
    if target.startswith("["):
        return target[1 : target.find("]")] if "]" in target else target
    if target.count(":") == 1:
        return target.split(":", 1)[0]
    # No port, or a bare IPv6 address.
    return target
