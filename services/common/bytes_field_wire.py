"""A message's large repeated `bytes` field (a request's images) written into and read out of its
wire bytes directly, without the protobuf runtime copying the values.

Why: every copy the runtime makes of a 15 MB image holds the GIL for the whole copy, and on fresh
memory most of that time is page faults (measured on this kind of machine: 20 ms to parse a 30 MB
GenerateRequest, 20 more to turn its images into Python bytes). In a worker that GIL is the one the
engine thread needs between steps, so each copy is a gap in every stream the worker runs; in the
gateway it is the event loop's. So:

- `append_bytes_field` writes the values after a message serialized without them: protobuf reads
  fields in any order and a repeated field's elements in the order they come, so a reader parses
  exactly the message built with them. Joining exact `bytes` objects releases the GIL (CPython's
  bytes.join does for large results), so made in a thread it costs the loop nothing.
- `split_bytes_field` walks a message's top-level fields and returns the field's values as views
  into the received bytes (no copy) and the rest of the message, to be parsed as usual (small).

Bounds: the walk is a Python loop, so it reads at most `max_fields` top-level fields (a proto3
message of ours has a few dozen; a forged one of millions of two-byte fields would hold the loop for
seconds, and would make a memoryview per value); past that the message is returned whole, for the
runtime's parser (C) and the usual checks.

Wire format: each field is a varint key (field number << 3 | wire type) then its value: a varint
(type 0), 8 bytes (1), a varint length and that many bytes (2), or 4 bytes (5). Groups (3, 4) are
not used by proto3 messages; a message holding one, or one that is malformed, is returned whole
and left to the runtime's parser, which accepts or refuses it as it always has.
"""

from __future__ import annotations

from collections.abc import Sequence

_LENGTH_DELIMITED = 2


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def append_bytes_field(head: bytes, field_number: int, values: Sequence[bytes | memoryview]) -> bytes:
    """`head` (a message serialized without the field) followed by each of `values` as an element
    of repeated bytes field `field_number`. One copy of every byte; the GIL is released for it when
    every value is an exact `bytes` (a memoryview keeps it held: CPython's rule for bytes.join)."""
    tag = encode_varint((field_number << 3) | _LENGTH_DELIMITED)
    parts: list[bytes | memoryview] = [head]
    for value in values:
        parts += (tag, encode_varint(len(value)), value)
    return b"".join(parts)


class _Malformed(Exception):
    pass


def _varint(wire: bytes, pos: int) -> tuple[int, int]:
    """(the varint at `pos`, the position after it)."""
    value = shift = 0
    while True:
        if pos >= len(wire) or shift > 63:
            raise _Malformed
        byte = wire[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


MAX_FIELDS = 4096


def split_bytes_field(wire: bytes, field_number: int,
                      max_fields: int = MAX_FIELDS) -> tuple[bytes, list[memoryview]]:
    """(the message's wire bytes without repeated bytes field `field_number`, that field's values in
    order as views into `wire`). `wire` unchanged and no values when the field is absent, or when
    the message is not one this walk reads (malformed, holding a group, or of more than
    `max_fields` top-level fields)."""
    view = memoryview(wire)
    values: list[memoryview] = []
    kept: list[memoryview] = []
    kept_from = pos = fields = 0
    try:
        while pos < len(wire):
            fields += 1
            if fields > max_fields:
                raise _Malformed
            start = pos
            key, pos = _varint(wire, pos)
            wire_type = key & 7
            if wire_type == 0:
                _, pos = _varint(wire, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == _LENGTH_DELIMITED:
                length, pos = _varint(wire, pos)
                if key >> 3 == field_number and pos + length <= len(wire):
                    kept.append(view[kept_from:start])
                    values.append(view[pos:pos + length])
                    kept_from = pos + length
                pos += length
            else:
                raise _Malformed
            if pos > len(wire):
                raise _Malformed
    except _Malformed:
        return wire, []
    if not values:
        return wire, []
    kept.append(view[kept_from:])
    return b"".join(kept), values
