"""The wire protocol of the `ucx` backend: tags, message layouts, and what each side sends.

All tags are forced, 64-bit (see the *_tag functions):
  connect:   sender -> receiver  CTRL   HELLO(sender uid, address length)
             sender -> receiver  ADDR   sender's worker address (the receiver's route for acks)
  write:     sender -> receiver  CTRL   BEGIN(sender uid, transfer id, header length) followed
                                        in the same message by the header JSON
                                        {key, grant (hex), runs: [[dst_page, length], ...]}; a
                                        header too big for CTRL_NBYTES goes separately on DATA
                                        (BEGIN_LONG)
             per run, in order:  DATA   the run's bytes, or an empty message once aborted
             finally             DATA   END(aborted?)
             receiver -> sender  ACK    (status, refused pages, transfer id, first refused page):
                                        OK, REJECTED (some run not granted: those runs went to
                                        scratch) or ABORTED
  verify:    sender -> receiver  CTRL   VERIFY(sender uid, request id, header length) + header
                                        {key, grant, runs} (VERIFY_LONG: header on DATA)
             receiver -> sender  ACK    OK or REJECTED, as for a write; nothing else moves
UCX matches messages of one tag from one endpoint in send order, so after the header the
receiver posts every run's receive at once (into pool pages if the grant covers them, else
into scratch) and then one for END. A sender that aborts still sends one message per run, empty,
which completes the posted receive without writing a byte: no receive stays posted into pool
pages waiting for data that will not come (unless the sender dies; then nothing can match it).
"""

from __future__ import annotations

import struct
from typing import Any

from libkv.transfer.errors import EngineUnavailable

CTRL_TAG = 0x5044_C7C7_0000_0001
CTRL = struct.Struct("<IIQQ")  # kind, sender uid, transfer id, length
END = struct.Struct("<IIQ")  # END kind, aborted flag, runs sent with data
ACK = struct.Struct("<IIQQ")  # status, refused pages, transfer id, first refused page
HELLO, BEGIN, BEGIN_LONG, VERIFY, VERIFY_LONG = 1, 2, 3, 4, 5
CTRL_NBYTES = 4096  # receive buffer of control messages (a smaller message fits): ~300 runs
END_KIND = 0x454E44
ACK_OK, ACK_REJECTED, ACK_ABORTED = 0, 1, 2


def data_tag(sender_uid: int, transfer_id: int) -> int:
    return (1 << 62) | (sender_uid << 31) | (transfer_id & 0x7FFF_FFFF)


def ack_tag(sender_uid: int, transfer_id: int) -> int:
    return (2 << 62) | (sender_uid << 31) | (transfer_id & 0x7FFF_FFFF)


def addr_tag(sender_uid: int) -> int:
    return (3 << 62) | (sender_uid << 31)


def import_ucxx():
    try:
        import numpy
        import ucxx
    except ImportError as exc:
        raise EngineUnavailable("the ucx backend needs pip install ucxx-cu12==0.52.0 "
                                "(ucx-py cannot be installed from PyPI)") from exc
    return ucxx, numpy


def abort_endpoint(ep: Any) -> None:
    try:
        ep.abort(period=10**9)  # bounded: the peer may be gone
    except Exception:
        pass
