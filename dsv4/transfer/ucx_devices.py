"""Which network devices UCX may use: only the interface the worker's gRPC server binds.

UCX's TCP transport listens on every interface it is allowed (UCX_NET_DEVICES, NIXL's
`ucx_devices` backend parameter); left alone, a worker bound to 127.0.0.1 would still accept KV
connections on eth0. `ucx_net_devices(host)` maps the bind address to devices:

- loopback (127.0.0.0/8, ::1, localhost): "lo";
- a wildcard (0.0.0.0, ::, empty): "" (UCX's default, every device: the worker is open anyway);
- any other address: the interface holding it, plus every RDMA port (`mlx5_0:1`, listed under
  /sys/class/infiniband), which moves KV without a TCP listener. An address no interface
  holds gives "" with a warning (the gRPC bind fails on it anyway).

Linux only (reads /proc and /sys); called once at worker start-up.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

logger = logging.getLogger(__name__)

LOOPBACK_DEVICE = "lo"
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
_INFINIBAND = Path("/sys/class/infiniband")


def ucx_net_devices(host: str) -> str:
    """UCX_NET_DEVICES for a worker bound to `host` ("" = every device)."""
    host = host.strip("[]") if host not in _WILDCARDS else host
    if host in _WILDCARDS:
        return ""
    address = _resolve(host)
    if address is None or address.is_loopback:
        return LOOPBACK_DEVICE if address is not None else ""
    interface = _interface_of(address)
    if interface is None:
        logger.warning("no network interface holds %s: UCX may use every device", host)
        return ""
    return ",".join([interface, *rdma_ports()])


def rdma_ports() -> list[str]:
    """Every RDMA device port as UCX names it ("mlx5_0:1"); empty without RDMA."""
    if not _INFINIBAND.is_dir():
        return []
    return sorted(
        f"{device.name}:{port.name}"
        for device in _INFINIBAND.iterdir()
        for port in (device / "ports").glob("*")
    )


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, ValueError, IndexError):
        logger.warning("cannot resolve worker host %r: UCX may use every device", host)
        return None


def _interface_of(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if address.version == 6:
        return _ipv6_interface(address)
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(reply[20:24]) == str(address):
                return name
    return None


def _ipv6_interface(address: ipaddress.IPv6Address) -> str | None:
    """From /proc/net/if_inet6: `<32 hex digits> <index> <prefix> <scope> <flags> <name>`."""
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and int(fields[0], 16) == int(address):
            return fields[5]
    return None
