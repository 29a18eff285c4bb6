"""What a process sees of the network between nodes: its host, its interfaces and their addresses, the interface
the collective backend was told to use, and the variables that change it. The network check before the first
step (utils/distributed.py) names them when it fails, and --dry-run prints them on every rank.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
# The variable that picks the interface of each backend (unset: the backend picks one itself, e.g. the first that
# is up and not loopback; inside a container without the host's network that is the container's own bridge).
INTERFACE_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
ADVICE = ("set NCCL_SOCKET_IFNAME (NCCL, GPUs) or GLOO_SOCKET_IFNAME (gloo, CPUs) on every node to the interface "
          "that reaches the master address (one of this host's above; e.g. eth0, ib0, not lo or docker0), "
          "NCCL_IB_DISABLE=1 where InfiniBand is absent or broken, and run containers with docker's host network "
          "(docker run --network=host); NCCL_DEBUG=INFO prints the interface NCCL chose; docs/failures.md, Multi-node "
          "networking")


def interfaces() -> dict[str, str | None]:
    """Each network interface of this host and its IPv4 address (None: it has none, or it is down)."""
    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                found[name] = None
    return found


def interface_setting(backend: str) -> str:
    """The interface `backend` was told to use, as `VARIABLE=value`, or that it chooses one itself."""
    variable = INTERFACE_VARIABLE.get(backend, "GLOO_SOCKET_IFNAME")
    value = os.environ.get(variable)
    return f"{variable}={value}" if value else f"{variable} unset: {backend} chooses the interface itself"


def master_answers(timeout: float = 1.0) -> str:
    """Whether MASTER_ADDR:MASTER_PORT accepts a TCP connection now, in words: a rank that cannot reach the
    master (a wrong address, a firewall) waits for it in silence, as one whose peers never come does."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return "no MASTER_ADDR and MASTER_PORT set"
    try:
        socket.create_connection((address, int(port)), timeout=timeout).close()
    except OSError as error:
        return f"master {address}:{port} did not accept a connection ({error.strerror or error})"
    return f"master {address}:{port} accepts connections"


def describe_host(backend: str) -> str:
    """One line of what this process sees: host, ranks, master, interface setting, interfaces and addresses."""
    env = os.environ
    where = (f"rank {env.get('RANK', '0')} of {env.get('WORLD_SIZE', '1')}, node {env.get('GROUP_RANK', '0')} "
             f"of {env.get('GROUP_WORLD_SIZE', env.get('SLURM_STEP_NUM_NODES', '1'))}")
    master = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '?')}" if "MASTER_ADDR" in env else "none"
    seen = ", ".join(f"{name} {address or '(no IPv4 address)'}" for name, address in interfaces().items())
    ib = f", NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']}" if "NCCL_IB_DISABLE" in env else ""
    return (f"host {socket.gethostname()} ({where}), master {master}, {interface_setting(backend)}{ib}; "
            f"interfaces: {seen or 'none'}")
