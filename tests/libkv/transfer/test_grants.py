"""Grant bookkeeping without an engine: tags, the receiver's table, spans and read slots, and
the expect/release rules every backend shares (through the `fake` backend)."""

import socket
import time

import numpy
import pytest

from libkv import KVLayout, KVPool
from libkv.transfer import GrantRefused, create_backend, grant_tag
from libkv.transfer.bind_host import bind_slots, bind_wildcard_to
from libkv.transfer.grants import (
    READ_SLOT_ENTRIES,
    READ_SLOTS,
    GrantTable,
    Refusal,
    compare_entries,
    rounds,
    spans,
)

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
GRANT_A, GRANT_B = bytes(range(16)), bytes(range(1, 17))


def receiver(num_pages=32):
    backend = create_backend("fake", timeout_s=1.0)
    backend.register(KVPool(LAYOUT, num_pages))
    return backend


def entry(backend, page) -> bytes:
    return backend.grants.entries[page].tobytes()


def test_tags_depend_on_key_and_grant_and_are_never_zero():
    tags = {grant_tag("room-1", GRANT_A), grant_tag("room-1", GRANT_B), grant_tag("room-2", GRANT_A),
            grant_tag("room-1"), grant_tag("room-2"), grant_tag("room-", b"1" + GRANT_A[1:])}
    assert len(tags) == 6 and all(len(t) == 16 and any(t) for t in tags)
    assert grant_tag("room-1", GRANT_A) == grant_tag("room-1", bytearray(GRANT_A))
    with pytest.raises(TypeError):
        grant_tag("room-1", GRANT_A.hex())
    with pytest.raises(ValueError):
        grant_tag("room-1", bytes(65))


def test_expect_binds_pages_and_release_zeroes_them():
    backend = receiver()
    backend.expect("room-1", [3, 4, 9], GRANT_A)
    tag = grant_tag("room-1", GRANT_A)
    assert [entry(backend, p) == tag for p in range(12)] == [p in (3, 4, 9) for p in range(12)]
    backend.expect("room-1", [10], GRANT_A)  # same key and grant: pages accumulate
    assert entry(backend, 10) == tag and backend.expected_pages("room-1") == {3, 4, 9, 10}
    backend.release_expectation("room-1")
    assert not backend.grants.entries.any()
    backend.expect("room-1", [3])  # an empty grant still binds (to the key alone)
    assert entry(backend, 3) == grant_tag("room-1")


def test_a_page_belongs_to_one_key_and_a_key_to_one_grant():
    backend = receiver()
    backend.expect("room-1", [3, 4], GRANT_A)
    with pytest.raises(ValueError, match=r"page 4 \(and 0 more\) already expected by 'room-1'"):
        backend.expect("room-2", [5, 4], GRANT_B)
    assert entry(backend, 5) == bytes(16)  # a refused expect binds nothing
    with pytest.raises(ValueError, match="another grant"):
        backend.expect("room-1", [6], GRANT_B)
    backend.release_expectation("room-1")
    backend.expect("room-2", [4], GRANT_B)  # free again once released
    assert entry(backend, 4) == grant_tag("room-2", GRANT_B)


def test_fake_verify_checks_nothing_but_validates_pages():
    sender, peer_backend = receiver(), receiver(num_pages=8)
    peer = sender.connect(peer_backend.endpoint())
    sender.verify_grant(peer, [1, 2], key="room-1", grant=GRANT_A)  # nothing reserved: still no error
    with pytest.raises(IndexError):
        sender.verify_grant(peer, [8], key="room-1", grant=GRANT_A)
    with pytest.raises(ValueError, match="repeat"):
        sender.verify_grant(peer, [1, 1], key="room-1", grant=GRANT_A)
    handle = sender.write(peer, [0], [1], key="room-1", grant=GRANT_A)
    assert handle.record.grant == GRANT_A and "grant" not in repr(handle.record)


def test_compare_names_the_first_refused_page_in_the_given_order():
    tag = grant_tag("room-1", GRANT_A)
    entries = numpy.frombuffer(tag * 5, dtype=numpy.uint8).reshape(5, 16).copy()
    assert compare_entries(entries, [7, 3, 4, 5, 6], tag) is None
    entries[3] = 0
    entries[1, 15] ^= 1
    assert compare_entries(entries, [7, 3, 4, 5, 6], tag) == Refusal(3, 2, 5)
    error = GrantRefused("refused", Refusal(3, 2, 5))
    assert error.refusal.first_page == 3


def test_spans_merge_near_pages_and_rounds_fit_a_slot():
    assert spans([9, 3, 4, 5]) == [(3, 7)]  # gap of 3 entries: one read
    assert spans([0, 200, 201, 1000]) == [(0, 1), (200, 2), (1000, 1)]
    long = spans(list(range(READ_SLOT_ENTRIES + 10)))
    assert long == [(0, READ_SLOT_ENTRIES), (READ_SLOT_ENTRIES, 10)]
    assert rounds(long) == [[(0, READ_SLOT_ENTRIES)], [(READ_SLOT_ENTRIES, 10)]]
    assert rounds([(0, 10), (100, 20), (500, 1)]) == [[(0, 10), (100, 20), (500, 1)]]


def test_read_slots_are_exclusive_and_retired_slots_come_back_when_idle():
    table = GrantTable(num_pages=4)
    taken = [table.acquire_slot(time.monotonic() + 1) for _ in range(READ_SLOTS)]
    assert sorted(taken) == list(range(READ_SLOTS))
    assert table.acquire_slot(time.monotonic() + 0.01) is None  # all busy
    busy = [True]
    table.retire_slot(taken[0], lambda: busy[0])  # an abandoned read may still land
    assert table.acquire_slot(time.monotonic() + 0.01) is None
    busy[0] = False
    assert table.acquire_slot(time.monotonic() + 1) == taken[0]
    table.release_slot(taken[1])
    assert table.acquire_slot(time.monotonic() + 1) == taken[1]
    # Slots sit right after the table in the registered memory, and do not overlap it.
    assert table.slot_address(0) == table.address() + table.table_nbytes


def test_bind_wildcard_to_rewrites_only_wildcard_binds_of_the_patched_library():
    import _socket

    if not getattr(_socket, "__file__", "") or not bind_slots(_socket.__file__):
        pytest.skip("this Python's socket module is not a shared object importing bind()")
    with bind_wildcard_to("127.0.0.1", [_socket.__file__]) as patch:
        assert patch.patched == [_socket.__file__]
        v4, v6, fixed = socket.socket(), socket.socket(socket.AF_INET6), socket.socket()
        v4.bind(("0.0.0.0", 0))
        v6.bind(("::", 0))
        fixed.bind(("127.0.0.1", 0))
        clash = socket.socket()
        with pytest.raises(OSError) as err:  # errno reaches the caller through the replacement
            clash.bind(("0.0.0.0", v4.getsockname()[1]))
        assert err.value.errno == 98
    after = socket.socket()
    after.bind(("0.0.0.0", 0))  # restored on exit
    try:
        assert v4.getsockname()[0] == "127.0.0.1"
        assert v6.getsockname()[0] == "::ffff:127.0.0.1"
        assert after.getsockname()[0] == "0.0.0.0"
    finally:
        for sock in (v4, v6, fixed, clash, after):
            sock.close()


class CopyingEngine:
    """Stands in for a one-sided engine: a "read" copies from another table's memory at once,
    or never finishes while `stuck`."""

    def __init__(self, peer_table: GrantTable) -> None:
        self.peer_table = peer_table
        self.operations = 0
        self.stuck = False
        self.released = 0

    def start(self, reads):
        import ctypes

        self.operations += 1
        if not self.stuck:
            for local, first, count in reads:
                ctypes.memmove(local, self.peer_table.address() + first * 16, count * 16)
        return self.stuck

    def progress(self, stuck):
        from libkv.transfer.interface import TransferState

        return TransferState.PENDING if self.stuck else TransferState.DONE

    def release(self, _op):
        self.released += 1


def test_grant_reader_reads_each_round_once_and_maps_entries_back_to_pages():
    from libkv.transfer.grants import GrantReader

    peer_table, local_table = GrantTable(12_000), GrantTable(16)
    tag = grant_tag("room-1", GRANT_A)
    pages = [11_999, 5, 6, 7, 300, 4_200, 4_201, *range(6_000, 6_000 + READ_SLOT_ENTRIES + 5)]
    peer_table.bind(pages, tag)
    peer_table.bind([8, 299], grant_tag("room-2", GRANT_A))  # read along with the pages, never compared
    engine = CopyingEngine(peer_table)
    reader = GrantReader(local_table, engine.start, engine.progress, engine.release, timeout_s=1.0)
    assert reader.verify(pages, tag) is None
    assert engine.operations == len(rounds(spans(pages))) == 3
    assert reader.verify([5, 8, 6, 299], tag) == Refusal(8, 2, 4)
    peer_table.clear([6_001])
    assert reader.verify(pages, tag) == Refusal(6_001, 1, len(pages))
    assert engine.released == engine.operations


def test_grant_reader_gives_up_after_its_timeout_and_keeps_the_slot_until_the_read_ends():
    from libkv.transfer.grants import GrantReader, ReadFailed

    engine = CopyingEngine(GrantTable(8))
    local_table = GrantTable(8)
    reader = GrantReader(local_table, engine.start, engine.progress, engine.release, timeout_s=0.05)
    engine.stuck = True
    for _ in range(READ_SLOTS):
        with pytest.raises(ReadFailed, match="took more than"):
            reader.verify([1], grant_tag("room-1"))
    with pytest.raises(ReadFailed, match="no grant read slot"):  # every slot may still be written
        reader.verify([1], grant_tag("room-1"))
    engine.stuck = False  # the abandoned reads end: their slots come back
    assert reader.verify([1], grant_tag("room-1")) == Refusal(1, 1, 1)
