"""Several "hosts" on one machine: Linux network namespaces on one bridge, for multi-host tests.

    with HostNetwork.create(["registry", "prefill", "decode", "gateway"]) as net:
        net.hosts["prefill"].address     # e.g. 10.214.7.3: bind it inside, dial it from anywhere
        net.hosts["prefill"].wrapper     # ("ip", "netns", "exec", NAME): run a process on that host

Each namespace has one veth link whose other end is a port of a bridge in this (the root)
namespace, and an address in one /24; the bridge holds the .1 address, so the test process
reaches every host too. A process on one host reaches the others only through its link (its own
loopback is private), as on separate machines on one switch. Needs root and iproute2, like
tools.chaos.netns, whose helpers and unavailability error it shares. Names carry the creating
process id, so concurrent runs do not collide and a run killed with -9 is cleaned up by the next.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from tools.chaos.netns import NetnsUnavailable, _ip, _pid_alive, _used_networks

PREFIX = "pdhost"  # namespaces pdhost-PID-N; bridge pdhPIDb; veths pdhPIDhN (here) / pdhPIDnN (inside)
_SUBNETS = ipaddress.ip_network("10.214.0.0/16")


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str

    @property
    def wrapper(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespace)


@dataclass
class HostNetwork:
    bridge: str
    bridge_address: str
    hosts: dict[str, Host] = field(default_factory=dict)
    _links: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, names: list[str]) -> HostNetwork:
        """One namespace per name on a new bridge. Raises NetnsUnavailable saying why it cannot."""
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed (scripts/setup.sh installs it)")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        remove_stale()
        pid = os.getpid()
        subnet = _free_subnet(pid)
        addresses = [str(address) for address in subnet.hosts()]
        net = cls(f"pdh{pid}b", addresses[0])
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.bridge_address}/{subnet.prefixlen}", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for index, name in enumerate(names):
                host = Host(name, f"{PREFIX}-{pid}-{index}", addresses[index + 1])
                outer, inner = f"pdh{pid}h{index}", f"pdh{pid}n{index}"
                _ip("netns", "add", host.namespace)
                net.hosts[name] = host
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                net._links.append(outer)
                _ip("link", "set", inner, "netns", host.namespace)
                _ip("link", "set", outer, "master", net.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", inner)
                _ip("-n", host.namespace, "link", "set", inner, "up")
                _ip("-n", host.namespace, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            net.remove()
            detail = getattr(exc, "stderr", "") or str(exc)
            raise NetnsUnavailable(f"cannot set up network namespaces on a bridge: {detail.strip()}") from exc
        return net

    def remove(self) -> None:
        """Delete the namespaces, links and bridge; safe to call twice and on a half-built network."""
        for host in self.hosts.values():
            _ip("netns", "del", host.namespace, check=False)
        for link in self._links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    subnets = list(_SUBNETS.subnets(new_prefix=24))
    used = _used_networks()
    for offset in range(len(subnets)):
        subnet = subnets[(seed + offset) % len(subnets)]
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetnsUnavailable("no free /24 in 10.214.0.0/16 for the hosts' bridge")


def remove_stale() -> None:
    """Delete the namespaces, links and bridges of runs whose process no longer exists."""
    stale: set[str] = set()
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        parts = line.split()[0].split("-") if line.split() else []
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _ip("netns", "del", "-".join(parts), check=False)
            stale.add(parts[1])
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        pid = name[3:].rstrip("b").split("h")[0] if name.startswith("pdh") else ""
        if pid.isdigit() and (pid in stale or not _pid_alive(int(pid))):
            _ip("link", "del", name, check=False)
