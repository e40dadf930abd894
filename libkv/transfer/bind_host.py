"""Make a native engine library bind one address where it hard-codes the wildcard.

Mooncake 0.3.13 creates both of its listeners (the P2P handshake socket and the TCP transport's
acceptor) with INADDR_ANY / in6addr_any written into the code; no option or environment variable
changes that (MC_TCP_BIND_ADDRESS only picks the address it *advertises*, and only without
P2PHANDSHAKE). So while the engine starts, `bind_wildcard_to(host, libraries)` swaps the
libraries' own import of libc `bind` (their GOT slot) for a function that rewrites a wildcard
address into `host` and calls the real `bind`; the slots are restored as soon as the engine is
up. Nothing else in the process is affected: other libraries and Python keep calling libc
directly, and a bind to a specific address passes through unchanged.

Linux, ELF64 (x86-64 and aarch64). Where the slot cannot be found the context manager says so
(`patched` stays empty) and the caller decides; it never guesses an address to write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import ipaddress
import logging
import mmap
import os
import socket
import struct
import threading
from _ctypes import CFuncPtr
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_SHT_RELA = 4
# (machine) -> relocation types that fill a function's GOT slot: (JUMP_SLOT, GLOB_DAT)
_SLOT_RELOCATIONS = {62: (7, 6), 183: (1026, 1025)}  # EM_X86_64, EM_AARCH64
_RTLD_DI_LINKMAP = 2
_PROT_READ, _PROT_WRITE = 1, 2

_BIND_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)
# Replacement functions stay referenced for the life of the process: a thread that read a slot
# just before it was restored may still be on its way into one.
_keep_alive: list = []
# One patch at a time: a nested one would save the other's replacement as the "original".
_patching = threading.Lock()


@dataclass(frozen=True)
class _Libc:
    bind: CFuncPtr
    errno_location: CFuncPtr
    mprotect: CFuncPtr
    dlinfo: CFuncPtr


@functools.cache
def _libc() -> _Libc:
    """glibc's functions, looked up on first use (so importing this module works anywhere)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.bind.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)
    libc.bind.restype = ctypes.c_int
    libc.__errno_location.restype = ctypes.POINTER(ctypes.c_int)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.dlinfo.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    return _Libc(libc.bind, libc.__errno_location, libc.mprotect, libc.dlinfo)


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "*")


def resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IP address `host` names (a literal, or the first address a name resolves to)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])


def bind_slots(path: str) -> list[int]:
    """Offsets (from the load base) of the GOT slots through which the ELF at `path` calls `bind`."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
            return []  # not a little-endian ELF64
        machine = struct.unpack_from("<H", elf, 0x12)[0]
        if machine not in _SLOT_RELOCATIONS:
            return []
        shoff, = struct.unpack_from("<Q", elf, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
        slots = []
        for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if kind != _SHT_RELA or not entsize:
                continue
            symtab, strtab = sections[link], sections[sections[link][6]]
            for at in range(offset, offset + size, entsize):
                r_offset, r_info = struct.unpack_from("<QQ", elf, at)
                if (r_info & 0xFFFF_FFFF) not in _SLOT_RELOCATIONS[machine] or not r_info >> 32:
                    continue
                st_name, = struct.unpack_from("<I", elf, symtab[4] + (r_info >> 32) * symtab[9])
                name_at = strtab[4] + st_name
                if elf[name_at:elf.find(b"\0", name_at)] == b"bind":
                    slots.append(r_offset)
        return slots


def _load_base(path: str) -> int:
    """Where the already-loaded library at `path` is mapped (its link map's l_addr)."""
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    link_map = ctypes.c_void_p()
    if _libc().dlinfo(handle, _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0 or link_map.value is None:
        raise OSError(f"dlinfo failed for {path}")
    return ctypes.c_size_t.from_address(link_map.value).value  # l_addr is the first field


def _rewriting_bind(address: ipaddress.IPv4Address | ipaddress.IPv6Address):
    """A C-callable `bind` that puts `address` where the caller asked for the wildcard."""
    v4 = address.packed if address.version == 4 else None
    v6 = address.packed if address.version == 6 else ipaddress.IPv6Address(f"::ffff:{address}").packed
    libc = _libc()

    def bind(fd: int, sockaddr: int, length: int) -> int:
        try:
            request = ctypes.create_string_buffer(ctypes.string_at(sockaddr, length), length)
            family = struct.unpack_from("=H", request, 0)[0]
            if family == socket.AF_INET and length >= 8 and request.raw[4:8] == bytes(4):
                if v4 is None:
                    log.warning("bind_host: an IPv4 wildcard bind cannot become %s; left as is", address)
                else:
                    struct.pack_into("4s", request, 4, v4)
            elif family == socket.AF_INET6 and length >= 24 and request.raw[8:24] == bytes(16):
                # An IPv4 host becomes ::ffff:a.b.c.d: a dual-stack socket then takes exactly the
                # IPv4 connections to that address (and fails to bind if the socket is v6-only).
                struct.pack_into("16s", request, 8, v6)
            result = libc.bind(fd, request, length)
            error = ctypes.get_errno()
        except BaseException:  # an exception would make ctypes return 0, i.e. "bound"
            log.exception("bind_host: rewriting a bind failed")
            result, error = -1, errno.EINVAL
        if result != 0:
            libc.errno_location()[0] = error  # the caller reads errno after we return
        return result

    function = _BIND_FN(bind)
    _keep_alive.append(function)
    return function


@dataclass
class BindPatch:
    """What bind_wildcard_to changed: the slots it patched, and why a library was left alone."""

    patched: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _page_writable(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return "w" in perms
    return False


def _write_pointer(address: int, value: int) -> None:
    """Write one pointer-sized slot, lifting a read-only (RELRO) protection for the write."""
    page = address & ~(mmap.PAGESIZE - 1)
    read_only = not _page_writable(address)
    if read_only and _libc().mprotect(page, mmap.PAGESIZE, _PROT_READ | _PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), f"mprotect of GOT page {page:#x}")
    ctypes.c_size_t.from_address(address).value = value
    if read_only:
        _libc().mprotect(page, mmap.PAGESIZE, _PROT_READ)


@contextlib.contextmanager
def bind_wildcard_to(host: str, libraries: list[str]) -> Iterator[BindPatch]:
    """While the block runs, wildcard binds made by `libraries` (paths of loaded ELF objects)
    bind `host` instead. A wildcard `host` changes nothing. Libraries that are not loaded, or
    whose import of bind cannot be found, are listed in the result's `skipped`."""
    patch = BindPatch()
    if is_wildcard(host):
        yield patch
        return
    replacement = ctypes.cast(_rewriting_bind(resolve(host)), ctypes.c_void_p).value
    if replacement is None:  # a CFUNCTYPE object always has an address; this says so to the checker
        raise OSError("no address for the replacement bind function")
    originals: list[tuple[int, int]] = []  # (slot address, what it held)
    with _patching:
        try:
            for path in libraries:
                try:
                    offsets = bind_slots(path)
                    base = _load_base(path) if offsets else 0
                except OSError as exc:
                    patch.skipped[path] = str(exc)
                    continue
                if not offsets:
                    patch.skipped[path] = "no GOT slot for bind (not an ELF64 x86-64/aarch64 import)"
                    continue
                for offset in offsets:
                    address = base + offset
                    originals.append((address, ctypes.c_size_t.from_address(address).value))
                    _write_pointer(address, replacement)
                patch.patched.append(path)
            yield patch
        finally:
            for address, original in originals:
                _write_pointer(address, original)
