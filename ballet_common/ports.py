"""Whether a listening address is taken, asked before a gRPC server binds it: grpcio's
C core logs its own line (``add_port.cc ... Address already in use``) on stderr before
the bind fails, ahead of the one clear line a command prints, so the commands probe the
address with a plain socket first and say it themselves."""

from __future__ import annotations

import errno
import socket


def in_use(address: str) -> bool:
    """True when ``host:port`` (``[::1]:PORT`` for IPv6; port 0 is never taken) is bound
    by another socket. Other failures (an unknown host, a privileged port) are False:
    the real bind reports them."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        return False
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: SO_REUSEADDR, so a port left in TIME_WAIT is not "in use".
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
    return False
