"""Large request bodies parsed off the event loop, in a small process pool.

Why a process and not a thread: every step of turning a 40 MB body of base64 images into bytes holds
the GIL (measured on this kind of machine, one 40 MB body with two 15 MB images: json.loads 190 ms,
pydantic's checks of the two 20 MB strings 50 ms, stripping whitespace 45 ms, each base64 decode
180 ms), so a thread would stall every other stream just the same. A body of LARGE_BODY_BYTES or more
is sent to a pool process instead, which parses the JSON, decodes every base64 image it finds (chat
`image_url` data: URLs, /generate's `image_data` data: URLs and plain base64) and puts a short
placeholder in each one's place. The event loop then validates a small body and ImageLoader takes
the decoded bytes from the request's DecodedImages.

A JSON body of a declared length of LARGE_BODY_BYTES or more is never whole in the gateway's memory:
each chunk the server hands over is appended to the request's body file as it arrives (BodySpool),
and the pool reads the file. Starlette's own body() keeps a list of chunks and joins them at the end,
which held the event loop for the whole body at once (30-60 ms for 40 MB, measured). A chunked body
(no length) is known to be large only once read: it is read whole and written out in a thread.

Bounds: at most `max_bodies` large bodies per gateway process are read or parsed at once (a
semaphore taken before the body is read when its Content-Length says it is large, so a flood of big
bodies waits on the socket instead of in memory); the pool's queue never holds more than that.
Bodies and images travel to and from the pool as files in memory
(/dev/shm), written and read with the GIL released, in a folder of their own per request
(`pdserve-body-<gateway pid>-<nonce>`) that the gateway removes when the parse ends, however it ends:
a client that disconnects mid-parse cancels the gateway's wait, not the pool's work, and the pool's
later writes into the removed folder fail (the pool removes what it wrote). A gateway that died
mid-parse leaves its folders behind: LargeBodies sweeps the folders of pids no longer alive at start.
A placeholder names this request's random nonce, so one written into a body by a client is never
taken for an image (it is refused as an unknown URL scheme).

Who calls: routes.router's route class (LargeBodyRoute) wraps each request in LargeBodyRequest;
FastAPI calls its body() then json(); ImageLoader.load takes `decoded_images(request)`. Whatever
way the request ends (answered, refused mid-body with 413 or 408 by middleware.BodyLimit, or the
client gone), LargeBodyRoute releases its slot and removes its folder.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import multiprocessing
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response

log = logging.getLogger("pdserve.gateway")

LARGE_BODY_BYTES = 1 << 20  # smaller bodies parse on the loop in well under the pool's round trip
LARGE_STRING_CHARS = 64 * 1024  # smaller base64 strings inside a large body stay as they are
MAX_LARGE_BODIES = 4
# Bodies and decoded images pass between the gateway and its pool as files here: memory, not disk.
SPOOL_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PLACEHOLDER_SCHEME = "pdserve-decoded"
_MIME_TYPES = ("image/png", "image/jpeg", "image/webp")  # images.MIME_TYPES, kept import-light for the pool


@dataclass
class DecodedImages:
    """The images a pool process decoded out of one request's body, by the placeholder that took
    each one's place. A value of None: that data: URL's payload was not valid base64."""

    by_placeholder: dict[str, bytes | None] = field(default_factory=dict)

    def get(self, source: str) -> tuple[bool, bytes | None]:
        """(found, bytes) for an image source of this request's body."""
        if not source.startswith(PLACEHOLDER_SCHEME) or source not in self.by_placeholder:
            return False, None
        return True, self.by_placeholder[source]


def _b64decode(payload: str) -> bytes | None:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def parse_body(body: bytes, nonce: str) -> tuple[Any, dict[str, bytes | None]]:
    """(the JSON value with decoded images replaced by placeholders, placeholder -> bytes). Runs in
    a pool process. A data: URL whose header is not an accepted image type, and plain base64 that
    does not decode, are left as they are: the loop's checks refuse them with their usual message."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:  # without the document: it would travel back whole
        raise json.JSONDecodeError(exc.msg, "", exc.pos) from None
    decoded: dict[str, bytes | None] = {}

    def swap(source: Any, bare: bool) -> Any:
        if not isinstance(source, str) or len(source) < LARGE_STRING_CHARS:
            return source
        if source.startswith("data:"):
            header, comma, payload = source[5:5 + 200].partition(",")
            mime, _, encoding = header.partition(";")
            if not comma or mime.lower() not in _MIME_TYPES or encoding.lower() != "base64":
                return source
            blob = _b64decode(source[5 + len(header) + 1:])
        elif bare:
            blob = _b64decode(source)
            if blob is None:
                return source
        else:
            return source
        placeholder = f"{PLACEHOLDER_SCHEME}:{nonce}/{len(decoded)}"
        decoded[placeholder] = blob
        return placeholder

    if isinstance(value, dict):
        for message in value.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                image_url = part.get("image_url") if isinstance(part, dict) else None
                if isinstance(image_url, dict):
                    image_url["url"] = swap(image_url.get("url"), bare=False)
        image_data = value.get("image_data")
        if isinstance(image_data, str):
            value["image_data"] = swap(image_data, bare=True)
        elif isinstance(image_data, list):
            for i, item in enumerate(image_data):
                if isinstance(item, list):
                    image_data[i] = [swap(inner, bare=True) for inner in item]
                else:
                    image_data[i] = swap(item, bare=True)
    return value, decoded


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _read_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size)  # one bytes object, filled with the GIL released
        if len(data) < size:  # a short read (not on tmpfs in practice): the rest, joined off the GIL
            parts = [data]
            while sum(len(p) for p in parts) < size:
                more = os.read(fd, size - sum(len(p) for p in parts))
                if not more:
                    raise OSError(f"{path} ended early")
                parts.append(more)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def parse_body_file(path: str, nonce: str) -> tuple[Any, dict[str, str | None]]:
    """parse_body over the body in `path` (removed once read); each decoded image is written to a
    file beside it, and its path (None: not valid base64) stands for it in the answer. The folder is
    never created here: once the gateway removed it (the request was cancelled), writing fails."""
    body = _read_file(path)
    os.unlink(path)
    value, decoded = parse_body(body, nonce)
    paths: dict[str, str | None] = {}
    try:
        for number, (placeholder, blob) in enumerate(decoded.items()):
            paths[placeholder] = None
            if blob is not None:
                blob_path = f"{path}.{number}"
                _write_file(blob_path, blob)
                paths[placeholder] = blob_path
    except BaseException:  # the gateway never learns these paths: remove them here
        for written in paths.values():
            if written is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(written)
        raise
    return value, paths


FOLDER_PREFIX = "pdserve-body-"
POOL_NICENESS = 10  # where SCHED_IDLE is refused: CFS weight about 1/10 of the gateway's


def _yield_to_the_gateway() -> None:
    """A pool process's initializer: parsing a body is bulk work that can wait a few milliseconds, a
    stream's next token cannot. So the pool runs under SCHED_IDLE: a core running only it counts as
    idle when the gateway (or a worker beside it) wakes, which then runs there at once. A lower
    niceness alone was not enough on two cores (`pdserve bench big-bodies`, docs/fleet.md): the
    scheduler left the parse alone on one core and queued the woken gateway behind other work on
    the other. The price: while every core is busy with other work, a large body waits."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux, or a sandbox that refuses it
        with contextlib.suppress(OSError):
            os.nice(POOL_NICENESS)


def remove_folder(folder: str) -> None:
    """Remove a request's folder and what is in it. A pool process may create a file in it between
    rmtree's listing and its rmdir (ENOTEMPTY): try again; once the folder is gone nothing lands in it."""
    for _ in range(100):
        try:
            shutil.rmtree(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            continue
    log.warning("could not remove %s", folder)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def sweep_dead_folders(spool_dir: str = SPOOL_DIR) -> list[str]:
    """Remove the request folders of gateways no longer running (by the pid in the name); the
    folders removed. Called when a gateway process starts its pool."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(spool_dir):
            pid_text = name[len(FOLDER_PREFIX):].partition("-")[0]
            if not name.startswith(FOLDER_PREFIX) or not pid_text.isdigit() or _pid_alive(int(pid_text)):
                continue
            folder = os.path.join(spool_dir, name)
            if os.path.isdir(folder):
                remove_folder(folder)
            else:  # a file from before bodies had folders of their own
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(folder)
            removed.append(folder)
    return removed


class BodySpool:
    """One large request body in a folder of its own under SPOOL_DIR (`pdserve-body-<pid>-<nonce>`):
    the body file, then the images the pool decodes beside it. Made by the gateway; `remove()` (any
    number of times) closes and removes all of it."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.folder = os.path.join(SPOOL_DIR, f"{FOLDER_PREFIX}{os.getpid()}-{self.nonce}")
        self.path = os.path.join(self.folder, "body")
        os.mkdir(self.folder, 0o700)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def write(self, chunk: bytes) -> None:
        """Append one chunk as the server hands it over (tens to hundreds of KB: a memory copy into
        tmpfs, cheaper than a thread hop). Joining a body's chunks at the end instead holds the event
        loop for the whole body at once (about 30 ms for 40 MB, most of it faulting in new pages)."""
        assert self._fd is not None, "written after finish()"
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view):]

    def finish(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        self.finish()
        remove_folder(self.folder)


class SpooledBody(bytes):
    """What LargeBodyRequest.body() returns for a body written to a BodySpool: empty bytes that are
    true. FastAPI only checks that a JSON body is not empty before it calls json(), which parses the
    file (nothing reads these bytes: bodies of other content types are never spooled)."""

    spool: BodySpool

    def __new__(cls, spool: BodySpool) -> SpooledBody:
        body = super().__new__(cls, b"")
        body.spool = spool
        return body

    def __bool__(self) -> bool:
        return True


class LargeBodies:
    """The pool (`processes` processes, started on first use) and the semaphore over large bodies;
    one per gateway process (app.state.large_bodies), closed at shutdown."""

    def __init__(self, processes: int, max_bodies: int = MAX_LARGE_BODIES) -> None:
        self.processes = processes
        self.slots = asyncio.Semaphore(max_bodies)
        self._pool: ProcessPoolExecutor | None = None
        if processes > 0:
            sweep_dead_folders()

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:  # spawn: the gateway holds threads and gRPC channels a fork would copy
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_yield_to_the_gateway)
        return self._pool

    async def parse(self, body: bytes) -> tuple[Any, DecodedImages]:
        """parse_spooled for a body already in memory (one whose length was not declared)."""
        spool = BodySpool()
        try:
            # written with os.write in a thread: it releases the GIL, where pickling the body for the
            # pool would hold it for a copy of every byte
            await asyncio.to_thread(spool.write, body)
            return await self.parse_spooled(spool)
        finally:
            spool.remove()

    async def parse_spooled(self, spool: BodySpool) -> tuple[Any, DecodedImages]:
        """The JSON value of the body in `spool` and the images the pool decoded out of it; the
        spool is removed when this ends, however it ends (also when cancelled: the pool may still be
        writing into it)."""
        spool.finish()
        loop = asyncio.get_running_loop()
        try:
            value, written = await loop.run_in_executor(self._executor(), parse_body_file, spool.path,
                                                        spool.nonce)
            decoded: dict[str, bytes | None] = {}
            for placeholder, blob_path in written.items():
                if blob_path is not None:  # read with the GIL released (unpickling would hold it)
                    decoded[placeholder] = await asyncio.to_thread(_read_file, blob_path)
                else:
                    decoded[placeholder] = None
            return value, DecodedImages(decoded)
        finally:
            spool.remove()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # its workers end with the gateway
            self._pool = None


def _declared_length(request: Request) -> int | None:
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):
        return None


class LargeBodyRequest(Request):
    """A request whose JSON body is parsed in the pool when it is large (see the module docstring).
    `release()` gives back its slot and removes its spool; LargeBodyRoute calls it when the request
    ends, however it ends (a disconnect or a 413/408 mid-body included)."""

    def __init__(self, request: Request, bodies: LargeBodies) -> None:
        super().__init__(request.scope, request.receive)
        self._bodies = bodies
        self._slot_held = False
        self._spool: BodySpool | None = None

    async def _take_slot(self) -> None:
        if not self._slot_held:
            await self._bodies.slots.acquire()
            self._slot_held = True

    def release(self) -> None:
        if self._spool is not None:
            self._spool.remove()
            self._spool = None
        if self._slot_held:
            self._slot_held = False
            self._bodies.slots.release()

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            declared = _declared_length(self)
            if declared is not None and declared >= LARGE_BODY_BYTES:
                await self._take_slot()  # before reading: the bytes wait on the socket, not here
                if _is_json(self.headers.get("content-type", "")):
                    self._body = await self._spool_body()
        return await super().body()

    async def _spool_body(self) -> SpooledBody:
        """The body written chunk by chunk to a BodySpool as it arrives: never whole in memory."""
        self._spool = spool = BodySpool()
        async for chunk in self.stream():
            spool.write(chunk)
        spool.finish()
        return SpooledBody(spool)

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                if isinstance(body, SpooledBody):
                    self._spool = None  # parse_spooled removes it
                    self._json, self.state.decoded_images = await self._bodies.parse_spooled(body.spool)
                elif len(body) < LARGE_BODY_BYTES:
                    self._json = json.loads(body)
                else:
                    await self._take_slot()  # a chunked body: known to be large only once read
                    self._json, self.state.decoded_images = await self._bodies.parse(body)
            finally:
                if isinstance(body, SpooledBody) or len(body) >= LARGE_BODY_BYTES:
                    self.release()
        return self._json


def _is_json(content_type: str) -> bool:
    """FastAPI's test for a JSON body (application/json or application/*+json)."""
    mime = content_type.partition(";")[0].strip().lower()
    major, _, minor = mime.partition("/")
    return major == "application" and (minor == "json" or minor.endswith("+json"))


def decoded_images(request: Request) -> DecodedImages | None:
    """The images the pool decoded out of this request's body (None: it was parsed on the loop)."""
    return getattr(request.state, "decoded_images", None)


class LargeBodyRoute(APIRoute):
    """An APIRoute whose requests parse large JSON bodies in the pool (app.state.large_bodies;
    absent or with no processes, every body parses on the loop as FastAPI's own route does)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            bodies = getattr(request.app.state, "large_bodies", None)
            if bodies is None or bodies.processes <= 0:
                return await handler(request)
            wrapped = LargeBodyRequest(request, bodies)
            try:
                return await handler(wrapped)
            finally:
                wrapped.release()

        return handle
