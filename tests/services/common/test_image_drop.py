"""The image drop over real sockets (services/common/image_drop.py): what is uploaded is what is
taken, once; forged, oversized, malformed, frozen and abandoned uploads are refused or dropped, and
the bytes they reserved come back."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from services.common.image_drop import MAGIC, DropRefused, ImageDrop, new_ticket, ticket_mac, upload

SECRET = b"s3cret"


@pytest.fixture
def drop():
    server = ImageDrop("127.0.0.1", secret=SECRET, max_upload_bytes=8 << 20, max_pending_bytes=12 << 20,
                       io_timeout_s=0.5, keep_s=30.0).start()
    yield server
    server.close()


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_what_is_uploaded_is_taken_once(drop: ImageDrop) -> None:
    images = [os.urandom(3 << 20), b"", os.urandom(1000)]
    ticket = new_ticket()
    upload("127.0.0.1", drop.port, ticket, images, secret=SECRET)
    assert drop.pending_bytes == sum(map(len, images))
    taken = drop.take(ticket)
    assert taken is not None and [bytes(view) for view in taken] == images
    assert drop.take(ticket) is None and drop.pending_bytes == 0
    assert drop.take(new_ticket()) is None  # never uploaded


def test_an_upload_without_the_secret_is_refused_and_stores_nothing(drop: ImageDrop) -> None:
    with pytest.raises(DropRefused, match="cluster secret"):
        upload("127.0.0.1", drop.port, new_ticket(), [b"x" * 100], secret=b"guess")
    with pytest.raises(DropRefused, match="cluster secret"):
        upload("127.0.0.1", drop.port, new_ticket(), [b"x" * 100])
    assert drop.stats.refused == {"unauthenticated": 2} and drop.pending_bytes == 0


def test_too_large_and_too_much_pending_are_refused_before_the_bytes(drop: ImageDrop) -> None:
    with pytest.raises(DropRefused, match="more than this worker takes"):
        upload("127.0.0.1", drop.port, new_ticket(), [bytes(5 << 20), bytes(4 << 20)], secret=SECRET)
    held = new_ticket()
    upload("127.0.0.1", drop.port, held, [bytes(7 << 20)], secret=SECRET)
    with pytest.raises(DropRefused, match="try again later"):
        upload("127.0.0.1", drop.port, new_ticket(), [bytes(6 << 20)], secret=SECRET)
    assert drop.take(held) is not None
    upload("127.0.0.1", drop.port, new_ticket(), [bytes(6 << 20)], secret=SECRET)  # room again


def test_a_ticket_cannot_be_uploaded_twice(drop: ImageDrop) -> None:
    ticket = new_ticket()
    upload("127.0.0.1", drop.port, ticket, [b"first"], secret=SECRET)
    with pytest.raises(DropRefused, match="ticket is taken"):
        upload("127.0.0.1", drop.port, ticket, [b"second"], secret=SECRET)
    assert [bytes(v) for v in drop.take(ticket) or ()] == [b"first"]


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\r\n\r\n" + bytes(64),  # not an upload
    struct.pack("<10s16s32sI", MAGIC, bytes(16), ticket_mac(SECRET, bytes(16)), 0),  # no images
    struct.pack("<10s16s32sI", MAGIC, bytes(16), ticket_mac(SECRET, bytes(16)), 10_000),  # too many
])
def test_a_malformed_head_is_refused(drop: ImageDrop, head: bytes) -> None:
    with socket.create_connection(("127.0.0.1", drop.port), timeout=5) as conn:
        conn.sendall(head)
        assert conn.recv(1) == b"\x01"
    wait_for(lambda: drop.stats.refused.get("malformed") == 1)


def test_a_sender_that_freezes_or_leaves_mid_image_frees_what_it_reserved(drop: ImageDrop) -> None:
    ticket = new_ticket()
    head = struct.pack("<10s16s32sIQ", MAGIC, ticket, ticket_mac(SECRET, ticket), 1, 1 << 20)
    with socket.create_connection(("127.0.0.1", drop.port), timeout=5) as frozen:
        frozen.sendall(head)
        assert frozen.recv(1) == b"\x00"  # go on
        frozen.sendall(bytes(1000))  # then nothing: the drop's read times out (0.5 s here)
        wait_for(lambda: drop.stats.refused.get("connection") == 1)
    assert drop.pending_bytes == 0 and drop.take(ticket) is None
    with socket.create_connection(("127.0.0.1", drop.port), timeout=5) as leaving:
        leaving.sendall(head)
        assert leaving.recv(1) == b"\x00"
        leaving.sendall(bytes(1000))
    wait_for(lambda: drop.stats.refused.get("connection") == 2)
    assert drop.pending_bytes == 0 and drop.take(ticket) is None


def test_an_upload_nobody_takes_expires() -> None:
    drop = ImageDrop("127.0.0.1", keep_s=0.2, io_timeout_s=1.0).start()
    try:
        ticket = new_ticket()
        upload("127.0.0.1", drop.port, ticket, [bytes(1000)])  # no secret in this deployment
        time.sleep(0.3)
        assert drop.take(ticket) is None and drop.pending_bytes == 0 and drop.stats.expired == 1
    finally:
        drop.close()


def test_a_drop_that_is_gone_or_frozen_is_a_refusal_not_a_hang() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(DropRefused, match="image drop"):
        upload("127.0.0.1", port, new_ticket(), [b"x"])
    with socket.create_server(("127.0.0.1", 0)) as frozen:  # accepts, never answers
        with pytest.raises(DropRefused, match="timed out"):
            upload("127.0.0.1", frozen.getsockname()[1], new_ticket(), [b"x"], timeout_s=0.3)


def test_more_senders_than_slots_are_told_so(drop: ImageDrop) -> None:
    server = ImageDrop("127.0.0.1", max_connections=1, io_timeout_s=2.0).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):  # holds the one slot
            time.sleep(0.1)
            with pytest.raises(DropRefused, match="too many uploads"):
                upload("127.0.0.1", server.port, new_ticket(), [b"x"])
    finally:
        server.close()


def test_a_sender_that_trickles_is_dropped_at_its_deadline(drop: ImageDrop) -> None:
    # 1 MB at the least rate the drop accepts (1 MB/s) plus its 0.5 s timeout: dropped after 1.5 s,
    # though a byte arrives well within every read's timeout
    ticket = new_ticket()
    head = struct.pack("<10s16s32sIQ", MAGIC, ticket, ticket_mac(SECRET, ticket), 1, 1 << 20)
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", drop.port), timeout=5) as trickling:
        trickling.sendall(head)
        assert trickling.recv(1) == b"\x00"
        while drop.stats.refused.get("connection", 0) == 0:
            assert time.monotonic() - began < 5, "never dropped"
            try:
                trickling.sendall(b"x")
            except OSError:
                break  # dropped
            time.sleep(0.1)
    wait_for(lambda: drop.stats.refused.get("connection") == 1)
    assert drop.pending_bytes == 0 and drop.take(ticket) is None
