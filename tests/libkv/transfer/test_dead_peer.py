"""A connection whose engine reports the peer unreachable is not used again: the next connect()
to the same endpoint makes a fresh one. Found by the chaos suite: after a network cut, NIXL kept
answering every request to the peer with NIXL_ERR_REMOTE_DISCONNECT, so one (prefill, decode)
pair failed for good while both workers were healthy.

The engine's failure is injected into the in-process `fake` backend; what is under test is the
backend base class's policy, which every real engine shares (the chaos suite's network-cut
scenarios exercise it with NIXL and Mooncake).
"""

from __future__ import annotations

import asyncio

import pytest

from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.transfer import PeerUnreachable, TransferState
from libkv.transfer.fake import FakeBackend
from tests.libkv.transfer.broken_connections import BrokenConnections

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


@pytest.fixture
def pair():
    sender, receiver = BrokenConnections(), FakeBackend()
    sender.register(KVPool(LAYOUT, 8))
    receiver.register(KVPool(LAYOUT, 8))
    yield sender, receiver.endpoint()
    sender.close()
    receiver.close()


def test_a_failed_write_makes_the_next_connect_reconnect(pair):
    sender, endpoint = pair
    sender.break_next = True
    broken = sender.connect(endpoint)
    sender.break_next = False
    handle = sender.write(broken, [0, 1], [2, 3], key="room-1")
    assert sender.poll(handle) is TransferState.FAILED
    with pytest.raises(PeerUnreachable, match="REMOTE_DISCONNECT"):
        asyncio.run(sender.wait(handle))
    with pytest.raises(PeerUnreachable, match="is dead"):  # at once, not through the engine again
        sender.write(broken, [0], [2], key="room-2")
    fresh = sender.connect(endpoint)
    assert fresh != broken and sender.connections == 2
    assert sender.poll(sender.write(fresh, [0], [2], key="room-3")) is TransferState.DONE
    assert sender.connect(endpoint) == fresh  # a working connection is reused


def test_a_failed_grant_read_makes_the_next_connect_reconnect(pair):
    sender, endpoint = pair
    sender.break_next = True
    broken = sender.connect(endpoint)
    sender.break_next = False
    with pytest.raises(PeerUnreachable, match="REMOTE_DISCONNECT"):
        sender.verify_grant(broken, [1, 2], key="room-1")
    fresh = sender.connect(endpoint)
    assert fresh != broken
    sender.verify_grant(fresh, [1, 2], key="room-2")
