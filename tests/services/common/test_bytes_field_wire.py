"""A repeated bytes field written into and cut out of a message's wire bytes
(services/common/bytes_field_wire.py) agrees with protobuf's own parse, and anything the walk does not
read is left whole for protobuf to judge."""

from __future__ import annotations

import os

import pytest

from protos.v1 import common_pb2, worker_pb2
from services.common.bytes_field_wire import append_bytes_field, encode_varint, split_bytes_field

IMAGES = worker_pb2.GenerateRequest.IMAGES_FIELD_NUMBER


def request(**fields) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(room="r1", prompt_token_ids=[5, 6, 300_000], lora_adapter="a",
                                      sampling=common_pb2.SamplingParams(max_new_tokens=3, temperature=0.5),
                                      carried_tokens=2, prefill_address="127.0.0.1:1", **fields)


@pytest.mark.parametrize("images", [[], [b""], [b"x" * 127, b"y" * 128],
                                    [os.urandom(16_384), os.urandom(300_000)]])
def test_appended_values_parse_as_the_message_built_with_them(images):
    built = request(images=images)
    wire = append_bytes_field(request().SerializeToString(), IMAGES, images)
    assert worker_pb2.GenerateRequest.FromString(wire) == built


def test_memoryviews_append_as_their_bytes():
    data = os.urandom(1000)
    wire = append_bytes_field(request().SerializeToString(), IMAGES, [memoryview(data)[10:20]])
    assert list(worker_pb2.GenerateRequest.FromString(wire).images) == [data[10:20]]


@pytest.mark.parametrize("images", [[b""], [b"a"], [os.urandom(200), b"", os.urandom(70_000)]])
def test_split_gives_the_values_in_order_and_the_rest_of_the_message(images):
    wire = request(images=images).SerializeToString()
    rest, values = split_bytes_field(wire, IMAGES)
    assert [bytes(v) for v in values] == images
    assert all(v.obj is wire for v in values)  # views into the received bytes, not copies
    assert worker_pb2.GenerateRequest.FromString(rest) == request()


def test_values_interleaved_with_other_fields_keep_their_order_and_the_fields_stay():
    head = worker_pb2.GenerateRequest(room="r1").SerializeToString()
    tail = worker_pb2.GenerateRequest(lora_adapter="b", prompt_token_ids=[1, 2]).SerializeToString()
    wire = append_bytes_field(head, IMAGES, [b"one"]) + tail + append_bytes_field(b"", IMAGES, [b"two"])
    rest, values = split_bytes_field(wire, IMAGES)
    assert [bytes(v) for v in values] == [b"one", b"two"]
    assert worker_pb2.GenerateRequest.FromString(rest) == worker_pb2.GenerateRequest(
        room="r1", lora_adapter="b", prompt_token_ids=[1, 2])


def test_a_message_without_the_field_comes_back_as_it_is():
    wire = request().SerializeToString()
    rest, values = split_bytes_field(wire, IMAGES)
    assert rest is wire and values == []


def _field(number: int, wire_type: int) -> bytes:
    return encode_varint((number << 3) | wire_type)


@pytest.mark.parametrize("wire", [
    request(images=[b"abc"]).SerializeToString()[:-1],  # the last value cut short
    _field(IMAGES, 2) + encode_varint(10) + b"abc",  # a length past the end
    _field(1, 2) + b"\xff\xff\xff",  # a varint that never ends
    _field(3, 3) + _field(3, 4),  # a group (not proto3)
    _field(2, 1) + b"1234",  # 8 fixed bytes announced, 4 there
    _field(2, 6),  # no such wire type
])
def test_what_the_walk_cannot_read_is_left_whole_for_protobuf(wire):
    rest, values = split_bytes_field(wire, IMAGES)
    assert rest is wire and values == []


def test_the_field_number_with_another_wire_type_stays_for_protobuf_to_judge():
    wire = request().SerializeToString() + _field(IMAGES, 0) + encode_varint(7)
    rest, values = split_bytes_field(wire, IMAGES)
    assert rest is wire and values == []
    # protobuf keeps it as an unknown field: no images, as before the walk existed
    assert list(worker_pb2.GenerateRequest.FromString(rest).images) == []


def test_a_message_of_more_fields_than_the_walk_reads_is_left_whole():
    # a forged request of many tiny values: split, it would be a memoryview each (and a long loop)
    wire = append_bytes_field(b"", IMAGES, [b""] * 10)
    assert split_bytes_field(wire, IMAGES, max_fields=9) == (wire, [])
    rest, values = split_bytes_field(wire, IMAGES, max_fields=10)
    assert rest == b"" and [bytes(v) for v in values] == [b""] * 10
