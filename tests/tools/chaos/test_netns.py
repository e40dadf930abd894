"""A real network namespace behind a veth link: reachable, cut (silently), restored, removed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tools.chaos.netns import NetnsUnavailable, NetworkNamespace

SERVER = ("import socket,sys; s=socket.create_server((sys.argv[1], 0)); "
          "print(s.getsockname()[1], flush=True); [s.accept()[0].close() for _ in iter(int, 1)]")


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def _connects_within(host: str, port: int, timeout_s: float = 10.0) -> bool:
    """Connects at all within `timeout_s` (a SYN lost while the neighbour entry is re-resolved is
    retransmitted only after a second; a loaded machine stretches that)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _connects(host, port):
            return True
    return False


def test_cut_restore_and_remove():
    try:
        ns = NetworkNamespace.create()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with ns:
        server = subprocess.Popen([*ns.wrapper, sys.executable, "-c", SERVER, ns.inner_address],
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            assert _connects(ns.inner_address, port)
            ns.cut()
            assert not _connects(ns.inner_address, port)
            ns.restore()
            assert _connects_within(ns.inner_address, port)
        finally:
            server.kill()
            server.wait()
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns.name not in listing
    assert subprocess.run(["ip", "link", "show", ns.host_dev], capture_output=True).returncode != 0


ECHO = ("import socket,sys,threading; s=socket.create_server((sys.argv[1], 0)); "
        "print(s.getsockname()[1], flush=True)\n"
        "def echo(c):\n    while (d := c.recv(64)): c.sendall(d)\n"
        "while True: threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()")


def test_idle_cut_drops_the_open_connections_silently_and_lets_new_ones_through():
    """cut_idle_flows: the connection open at the cut gets no answer and no RST (a send succeeds,
    nothing comes back); a connection opened after it works; restored, the old one answers again."""
    try:
        ns = NetworkNamespace.create()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with ns:
        server = subprocess.Popen([*ns.wrapper, sys.executable, "-c", ECHO, ns.inner_address],
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            old = socket.create_connection((ns.inner_address, port), timeout=10)
            old.sendall(b"a")
            assert old.recv(1) == b"a"
            assert ns.cut_idle_flows(port) == 1
            old.settimeout(1.5)
            old.sendall(b"b")
            with pytest.raises(TimeoutError):  # silently dropped: neither an answer nor a reset
                old.recv(1)
            with socket.create_connection((ns.inner_address, port), timeout=10) as new:
                new.sendall(b"c")
                assert new.recv(1) == b"c"
            ns.restore_idle_flows()
            old.settimeout(30)  # the "b" comes back with TCP's next retransmission
            assert old.recv(1) == b"b"
            old.close()
        finally:
            server.kill()
            server.wait()
