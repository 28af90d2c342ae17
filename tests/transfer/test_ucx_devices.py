"""`ucx_net_devices`: the bind address decides which interfaces UCX may listen on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dsv4.transfer.ucx_devices import ucx_net_devices


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_get_only_lo(host: str) -> None:
    assert ucx_net_devices(host) == "lo"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_wildcards_leave_every_device(host: str) -> None:
    assert ucx_net_devices(host) == ""


def test_an_address_no_interface_holds_leaves_every_device() -> None:
    assert ucx_net_devices("203.0.113.77") == ""  # TEST-NET-3: never assigned here


def test_an_interface_address_maps_to_that_interface() -> None:
    """Every IPv6 address in /proc/net/if_inet6 names its interface (RDMA ports appended)."""
    rows = [line.split() for line in Path("/proc/net/if_inet6").read_text().splitlines()]
    rows = [r for r in rows if r[5] != "lo" and not r[0].startswith("fe80")]  # link-local: scoped
    if not rows:
        pytest.skip("no global IPv6 address on a non-loopback interface")
    for fields in rows:
        address = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
        assert ucx_net_devices(address).split(",")[0] == fields[5]
