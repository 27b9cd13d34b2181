"""Outbound channels: plaintext only to loopback or when insecure (docs/spec/authority.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ballet_common.addresses import is_loopback
from ballet_common.grpc.channels import ChannelTls, make_channel


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("127.0.0.1:50052", True),
        ("127.8.9.10:1", True),
        ("localhost:50052", True),
        ("LOCALHOST", True),
        ("[::1]:50052", True),
        ("::1", True),
        ("dns:///localhost:50052", True),
        ("ipv4:127.0.0.1:1,127.0.0.2:2", True),
        ("unix:/run/tracker.sock", True),
        ("10.0.0.7:50052", False),
        ("tracker.internal:443", False),
        ("dns:///tracker.internal:443", False),
        ("ipv4:127.0.0.1:1,10.0.0.1:2", False),
        ("[2001:db8::1]:443", False),
        ("localhost.evil.example:1", False),
    ],
)
def test_loopback_addresses(address: str, local: bool) -> None:
    assert is_loopback(address) is local


async def test_plaintext_to_a_remote_address_needs_insecure() -> None:
    with pytest.raises(ValueError, match="insecure = true"):
        make_channel("tracker.internal:443", tls=None, insecure=False)
    channel = make_channel("tracker.internal:443", tls=None, insecure=True)
    await channel.close()
    channel = make_channel("127.0.0.1:50052", tls=None, insecure=False, max_receive_bytes=1 << 20)
    await channel.close()


async def test_tls_needs_both_halves_of_a_client_certificate(tmp_path: Path) -> None:
    half = ChannelTls(cert_file=tmp_path / "client.pem")
    with pytest.raises(ValueError, match="both a client certificate and its key"):
        make_channel("tracker.internal:443", tls=half, insecure=False)
    # TLS with the system's roots needs no file at all.
    channel = make_channel("tracker.internal:443", tls=ChannelTls(), insecure=False)
    await channel.close()


async def test_a_missing_certificate_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        make_channel(
            "tracker.internal:443", tls=ChannelTls(ca_file=tmp_path / "nope.pem"), insecure=False
        )
