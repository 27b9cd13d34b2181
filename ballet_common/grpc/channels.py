"""Outbound gRPC channels to the planner's dependencies (docs/spec/authority.md and
docs/spec/limits.md).

Every outbound channel takes TLS settings (CA, and for mTLS a client certificate and
key); plaintext is allowed only to a loopback address or with an explicit
``insecure = true`` (docs/spec/authority.md, Identity and authority). Keepalive follows
docs/spec/limits.md: a ping every 60 s with a 20 s timeout.

Nothing here does I/O at import time; certificate files are read when a channel is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from ballet_common.addresses import is_loopback

#: Keepalive of every outbound channel, in milliseconds (docs/spec/limits.md).
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


@dataclass(frozen=True)
class ChannelTls:
    """TLS settings of one outbound channel.

    ``ca_file`` is a PEM bundle of the roots to trust (None: the system's roots).
    ``cert_file`` and ``key_file`` are the planner's client certificate and key in PEM,
    for mTLS; give both or neither. ``server_name`` overrides the name checked against the
    server's certificate (for addresses that are not the certificate's name).
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None


def make_channel(
    address: str,
    *,
    tls: ChannelTls | None,
    insecure: bool,
    max_receive_bytes: int | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """Make a ``grpc.aio`` channel to ``address`` (``host:port``, ``[v6]:port``,
    ``dns:///host:port``, ``unix:path``...).

    With ``tls``, a secure channel (mTLS when a client certificate is configured). Without
    it, a plaintext channel, but only to a loopback address or a Unix socket, or when
    ``insecure`` is true. ``max_receive_bytes`` caps received messages (bytes; None: gRPC's
    default of 4 MiB). ``interceptors`` see every call (tracing: none when it is off).

    Raises ``ValueError`` (plaintext to a non-loopback address without ``insecure``, or
    only one of ``cert_file``/``key_file``) and ``OSError`` (a certificate file cannot be
    read).
    """
    options: list[tuple[str, int | str]] = [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # With this grpcio the wait for a ping's answer is this option; the one above
        # alone leaves it at 60 s.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]
    if max_receive_bytes is not None:
        if max_receive_bytes <= 0:
            raise ValueError("max_receive_bytes must be positive")
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    if tls is not None:
        if (tls.cert_file is None) != (tls.key_file is None):
            raise ValueError(
                f"TLS for {address}: give both a client certificate and its key, or neither"
            )
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(tls.ca_file),
            private_key=_read(tls.key_file),
            certificate_chain=_read(tls.cert_file),
        )
        return grpc.aio.secure_channel(
            address, credentials, options=options, interceptors=interceptors or None
        )
    if not insecure and not is_loopback(address):
        raise ValueError(
            f"refusing a plaintext channel to {address}: configure TLS for it, or set "
            "insecure = true to allow plaintext to a non-loopback address"
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()
