"""Image bytes carried beside gRPC: a worker's drop that a gateway uploads a request's images to
before its Generate call, which then names them by a ticket.

Why: gRPC's Python layer copies every received message into bytes with the GIL held, and a worker's
engine thread needs the GIL between steps. A 30 MB image message stalled every stream on the worker
for tens of milliseconds (`pdserve bench big-bodies`: pinned, the worker's own gaps over 40 ms
matched the clients' gaps over twice idle; with the images left out of the message, none). Here the
bytes go over a plain TCP connection read with `recv_into` in a thread: the kernel's copy runs with
the GIL released, into an anonymous mmap whose pages the kernel zero-fills as they are written
(a bytearray would memset 30 MB with the GIL held first).

Wire (little-endian), one upload per connection:
    client: MAGIC, ticket (16 bytes), mac (32), count (u32), count sizes (u64)
    server: an answer: go on (u8 0), or refused (u8 1, a u16 length, a UTF-8 reason)
    client: the images' bytes, one after another
    server: an answer: stored (u8 0), or refused
The first answer lets a refused sender stop before it writes megabytes nobody reads.

`mac` is HMAC-SHA256(cluster secret, ticket) when the deployment has a secret (services/common/
security.py), else ignored. The server bounds what one upload and all pending uploads may hold,
the connections served at once, and every read by a timeout (a sender that freezes is dropped);
an upload nobody takes within `keep_s` is dropped. A ticket is 16 random bytes: knowing one is the
only way to take its images.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.image_drop")

MAGIC = b"PDIMGDROP1"
TICKET_BYTES = 16
_HEAD = struct.Struct(f"<{len(MAGIC)}s{TICKET_BYTES}s32sI")
MAX_IMAGES = 64
GO_ON = STORED = 0
REFUSED = 1
_READ_AT_ONCE = 4 << 20  # bytes per recv_into: each call releases the GIL for its copy
# A sender slower than this is dropped, however often it sends a byte: one that trickles would
# otherwise hold a connection slot and its reserved bytes for ever.
MIN_BYTES_PER_S = 1 << 20


@dataclass(frozen=True)
class DropTarget:
    """A worker's image drop as a gateway reaches it."""

    host: str
    port: int
    secret: bytes = field(default=b"", repr=False)


class DropRefused(Exception):
    """The drop refused an upload (the reason says why), or it could not be reached or answer."""


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def ticket_mac(secret: bytes, ticket: bytes) -> bytes:
    return hmac.new(secret, ticket, hashlib.sha256).digest() if secret else bytes(32)


@dataclass
class DropStats:
    stored: int = 0
    taken: int = 0
    expired: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


@dataclass
class _Upload:
    images: tuple[memoryview, ...]
    nbytes: int
    expires_at: float


class ImageDrop:
    """The worker's side: a listening socket, a thread accepting on it and one per connection (at
    most `max_connections` at once), and the uploads stored until taken or expired."""

    def __init__(self, host: str, port: int = 0, *, secret: bytes = b"", max_upload_bytes: int = 256 << 20,
                 max_pending_bytes: int = 512 << 20, max_connections: int = 8, io_timeout_s: float = 10.0,
                 keep_s: float = 60.0) -> None:
        self.secret = secret
        self.max_upload_bytes = max_upload_bytes
        self.max_pending_bytes = max_pending_bytes
        self.io_timeout_s = io_timeout_s
        self.keep_s = keep_s
        self.stats = DropStats()
        self._uploads: dict[bytes, _Upload] = {}
        self._pending_bytes = 0  # stored plus being received
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener = socket.create_server((host, port), backlog=max_connections * 2)
        self._listener.settimeout(0.5)  # so close() is noticed
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="image-drop", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def start(self) -> ImageDrop:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop taking uploads and drop what is held. The accept thread notices within half a
        second (not waited for: a worker on its way out should not); an upload in flight is refused
        when it ends."""
        self._closed.set()
        self._listener.close()
        with self._lock:
            self._uploads.clear()
            self._pending_bytes = 0

    def take(self, ticket: bytes) -> tuple[memoryview, ...] | None:
        """The images uploaded under `ticket`, once; None if there are none (never uploaded, taken
        already, or expired)."""
        with self._lock:
            self._expire(time.monotonic())
            upload = self._uploads.pop(bytes(ticket), None)
            if upload is None:
                return None
            self._pending_bytes -= upload.nbytes
            self.stats.taken += 1
        return upload.images

    # ---- the threads ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.stats.refuse("busy")
                threading.Thread(target=self._refuse_and_close, args=(conn, "too many uploads at once"),
                                 daemon=True).start()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="image-drop-upload", daemon=True).start()

    def _refuse_and_close(self, conn: socket.socket, reason: str) -> None:
        with conn:
            conn.settimeout(self.io_timeout_s)
            _answer(conn, REFUSED, reason)

    def _serve(self, conn: socket.socket) -> None:
        reserved = 0
        try:
            with conn:
                conn.settimeout(self.io_timeout_s)
                try:
                    ticket, sizes = self._read_head(conn)
                    reserved = self._reserve(ticket, sum(sizes))
                    _answer(conn, GO_ON, "")
                    images = _receive(conn, sizes, self.io_timeout_s)
                except _Refusal as exc:
                    self.stats.refuse(exc.kind)
                    _answer(conn, REFUSED, str(exc))
                    return
                if not self._store(ticket, images, reserved):
                    self.stats.refuse("duplicate")
                    _answer(conn, REFUSED, "that ticket is taken")
                    return
                reserved = 0  # the stored upload holds them now
                _answer(conn, STORED, "")
        except OSError as exc:  # the sender left, froze past the timeout, or reset the connection
            self.stats.refuse("connection")
            log.debug("image upload dropped: %s", exc)
        finally:
            if reserved:
                with self._lock:
                    self._pending_bytes -= reserved
            self._slots.release()

    def _read_head(self, conn: socket.socket) -> tuple[bytes, tuple[int, ...]]:
        magic, ticket, mac, count = _HEAD.unpack(_read_exact(conn, _HEAD.size))
        if magic != MAGIC:
            raise _Refusal("malformed", "not an image upload")
        if self.secret and not hmac.compare_digest(mac, ticket_mac(self.secret, ticket)):
            raise _Refusal("unauthenticated", "the upload does not carry the cluster secret")
        if not 1 <= count <= MAX_IMAGES:
            raise _Refusal("malformed", f"an upload holds 1 to {MAX_IMAGES} images, not {count}")
        sizes = struct.unpack(f"<{count}Q", _read_exact(conn, 8 * count))
        if sum(sizes) > self.max_upload_bytes:
            raise _Refusal("too_large", f"{sum(sizes)} bytes of images: more than this worker takes in one "
                                        f"request ({self.max_upload_bytes})")
        return ticket, sizes

    def _reserve(self, ticket: bytes, nbytes: int) -> int:
        with self._lock:
            self._expire(time.monotonic())
            if ticket in self._uploads:
                raise _Refusal("duplicate", "that ticket is taken")
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                raise _Refusal("busy", "this worker holds as many image bytes as it may; try again later")
            self._pending_bytes += nbytes
        return nbytes

    def _store(self, ticket: bytes, images: tuple[memoryview, ...], nbytes: int) -> bool:
        """Keep the upload under `ticket`; False if the same ticket raced in first (that one stays) or
        the drop is closed."""
        with self._lock:
            if ticket in self._uploads or self._closed.is_set():
                return False
            self._uploads[ticket] = _Upload(images, nbytes, time.monotonic() + self.keep_s)
            self.stats.stored += 1
            return True

    def _expire(self, now: float) -> None:
        """Drop uploads past their time (called with the lock held)."""
        for ticket in [t for t, u in self._uploads.items() if u.expires_at <= now]:
            self._pending_bytes -= self._uploads.pop(ticket).nbytes
            self.stats.expired += 1


class _Refusal(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def _read_exact(conn: socket.socket, nbytes: int) -> bytes:
    chunks, left = [], nbytes
    while left:
        chunk = conn.recv(min(left, 65536))
        if not chunk:
            raise ConnectionError("the sender closed the connection early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(conn: socket.socket, sizes: Sequence[int], io_timeout_s: float) -> tuple[memoryview, ...]:
    """The images' bytes, read into one anonymous mapping (pages zero-filled by the kernel as the
    copy reaches them, not up front) and cut into a view per image; TimeoutError past
    `io_timeout_s` plus a second per MIN_BYTES_PER_S."""
    total = sum(sizes)
    buffer = mmap.mmap(-1, max(total, 1))
    whole = memoryview(buffer)[:total]
    deadline = time.monotonic() + io_timeout_s + total / MIN_BYTES_PER_S
    done = 0
    while done < total:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(f"{done} of {total} bytes by the deadline")
        conn.settimeout(min(io_timeout_s, left_s))
        got = conn.recv_into(whole[done:], min(total - done, _READ_AT_ONCE))
        if not got:
            raise ConnectionError("the sender closed the connection mid-image")
        done += got
    views, start = [], 0
    for size in sizes:
        views.append(whole[start:start + size])
        start += size
    return tuple(views)


def _answer(conn: socket.socket, status: int, reason: str) -> None:
    text = reason.encode()[:1000]
    try:
        conn.sendall(struct.pack("<B", status) + (struct.pack("<H", len(text)) + text if status else b""))
    except OSError:
        pass  # the sender is gone; nothing to tell


def upload(host: str, port: int, ticket: bytes, images: Sequence[bytes | memoryview], *, secret: bytes = b"",
           timeout_s: float = 30.0) -> None:
    """The gateway's side (blocking: call it in a thread): send `images` under `ticket` and wait
    until the drop stored them. Raises DropRefused with the drop's reason, or when it could not be
    reached or did not answer within `timeout_s` per read or write."""
    head = _HEAD.pack(MAGIC, ticket, ticket_mac(secret, ticket), len(images))
    sizes = struct.pack(f"<{len(images)}Q", *(len(memoryview(image)) for image in images))
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(head + sizes)
            _read_answer(conn)  # refused here: too large, busy, not authenticated
            for image in images:
                conn.sendall(memoryview(image))  # the GIL is released for each send
            _read_answer(conn)
    except OSError as exc:
        raise DropRefused(f"image drop {host}:{port}: {exc}") from None


def _read_answer(conn: socket.socket) -> None:
    status = _read_exact(conn, 1)[0]
    if status != STORED:
        (length,) = struct.unpack("<H", _read_exact(conn, 2))
        raise DropRefused(_read_exact(conn, length).decode(errors="replace"))
