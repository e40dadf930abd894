"""A Linux network namespace joined to this one by a veth link, to cut one worker off the network.

    with NetworkNamespace.create() as ns:        # raises NetnsUnavailable with the reason if it cannot
        ns.host_address, ns.inner_address        # e.g. 10.213.5.1 (here) and 10.213.5.2 (inside)
        ns.wrapper                               # ("ip", "netns", "exec", NAME): run a process inside
        ns.cut(); ns.restore()
        ns.cut_idle_flows(port); ns.restore_idle_flows()   # idle-cut: drop the flows open now

The worker inside binds `inner_address`; every other process binds `host_address`, an address of this
namespace that stays reachable from inside (and, being local, from here even while the link is cut).
`cut` sets the link's inside end down: packets from here to the worker are dropped silently, as in a
real partition, while the worker's own sends fail at once (its interface is gone). Setting the outer
end down instead would remove the route here and send the worker's traffic out of the default route.
`cut_idle_flows` models a stateful firewall or NAT that forgot idle connections: the packets of the
TCP connections open now to one port inside are dropped silently (no RST), while new connections
pass. Needs root and iproute2 (`ip`, `ss`), and iptables for the idle cut; scripts/setup.sh
installs them. Names carry the creating process
id, so concurrent runs do not collide and `remove_stale` can clean up after a run killed with -9.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "pdchaos"  # namespace names: pdchaos-PID-N; veth names: pdcPIDhN / pdcPIDnN (15 chars max)
_SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # carved into /30 links
_INDEXES = itertools.count()  # namespaces created by this process, for unique names


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here; the message says why (printed when the scenario is skipped)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


def _free_link_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /30 of 10.213.0.0/16 that no local interface uses, starting from a spot chosen by `seed`."""
    links = list(_SUBNETS.subnets(new_prefix=30))
    used = _used_networks()
    for offset in range(len(links)):
        link = links[(seed + offset) % len(links)]
        if not any(link.overlaps(net) for net in used):
            return link
    raise NetnsUnavailable("no free /30 in 10.213.0.0/16 for a veth link")


@dataclass
class NetworkNamespace:
    """One namespace `name` with the veth pair `host_dev` (here) / `inner_dev` (inside). Removing the
    namespace destroys the inside end, and with it the pair."""

    name: str
    host_dev: str
    inner_dev: str
    host_address: str
    inner_address: str
    _idle_rules: list[list[str]] = field(default_factory=list)  # cut_idle_flows's, to delete

    @classmethod
    def create(cls) -> NetworkNamespace:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed (scripts/setup.sh installs it)")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        remove_stale()
        pid, index = os.getpid(), next(_INDEXES)
        link = _free_link_subnet(pid * 7 + index)
        host_ip, inner_ip = list(link.hosts())
        ns = cls(f"{PREFIX}-{pid}-{index}", f"pdc{pid}h{index}", f"pdc{pid}n{index}", str(host_ip),
                 str(inner_ip))
        try:
            ns._build(link.prefixlen)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            ns.remove()
            detail = getattr(exc, "stderr", "") or str(exc)
            raise NetnsUnavailable(f"cannot set up a network namespace: {detail.strip()}") from exc
        return ns

    def _build(self, prefixlen: int) -> None:
        _ip("netns", "add", self.name)
        _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.inner_dev)
        _ip("link", "set", self.inner_dev, "netns", self.name)
        _ip("addr", "add", f"{self.host_address}/{prefixlen}", "dev", self.host_dev)
        _ip("link", "set", self.host_dev, "up")
        _ip("-n", self.name, "addr", "add", f"{self.inner_address}/{prefixlen}", "dev", self.inner_dev)
        _ip("-n", self.name, "link", "set", self.inner_dev, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")

    @property
    def wrapper(self) -> tuple[str, ...]:
        """Prefix of a command line that runs the command inside the namespace."""
        return ("ip", "netns", "exec", self.name)

    def cut(self) -> None:
        _ip("-n", self.name, "link", "set", self.inner_dev, "down")

    def restore(self, timeout_s: float = 5.0) -> None:
        """Set the link up again and wait (bounded) until both ends have carrier: right after `up` a
        veth can still drop the first packets, which would stretch the cut by a retransmit."""
        _ip("-n", self.name, "link", "set", self.inner_dev, "up")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            inner = _ip("-n", self.name, "link", "show", self.inner_dev, check=False).stdout
            outer = _ip("link", "show", self.host_dev, check=False).stdout
            if "LOWER_UP" in inner and "LOWER_UP" in outer:
                return
            time.sleep(0.05)

    def open_flows(self, port: int) -> list[tuple[str, int]]:
        """(peer address, peer port) of each established TCP connection to `port` inside."""
        out = subprocess.run([*self.wrapper, "ss", "-Htn", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        flows = []
        for line in out.splitlines():
            peer = line.split()[-1]  # Recv-Q Send-Q Local:Port Peer:Port
            host, _, peer_port = peer.rpartition(":")
            flows.append((host.strip("[]"), int(peer_port)))
        return flows

    def cut_idle_flows(self, port: int) -> int:
        """Drop, silently and in both directions, every packet of the TCP connections to `port`
        inside that are open now (an idle-cut middlebox); connections opened later pass. Returns
        how many were cut. `restore_idle_flows` removes the rules."""
        if shutil.which("iptables") is None:
            raise NetnsUnavailable("iptables is not installed (scripts/setup.sh installs it)")
        flows = self.open_flows(port)
        for host, peer_port in flows:
            for rule in (["INPUT", "-s", host, "-p", "tcp", "--sport", str(peer_port),
                          "--dport", str(port)],
                         ["OUTPUT", "-d", host, "-p", "tcp", "--sport", str(port),
                          "--dport", str(peer_port)]):
                subprocess.run([*self.wrapper, "iptables", "-I", *rule, "-j", "DROP"], capture_output=True,
                               text=True, timeout=10, check=True)
                self._idle_rules.append(rule)
        return len(flows)

    def restore_idle_flows(self) -> None:
        """Remove the rules of `cut_idle_flows` (safe to call when there are none)."""
        rules, self._idle_rules = self._idle_rules, []
        for rule in rules:
            subprocess.run([*self.wrapper, "iptables", "-D", *rule, "-j", "DROP"], capture_output=True,
                           text=True, timeout=10, check=False)

    def remove(self) -> None:
        """Delete the namespace and the link; safe to call twice and on a half-built namespace."""
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_dev, check=False)

    def __enter__(self) -> NetworkNamespace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def remove_stale() -> None:
    """Delete pdchaos namespaces (and links) left by runs whose process no longer exists."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _ip("netns", "del", name, check=False)
            _ip("link", "del", f"pdc{parts[1]}h{parts[2]}", check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
