"""In-process tests of the backend interface through the `fake` backend (no engine involved)."""

import subprocess
import sys
from pathlib import Path

import pytest

from libkv import KVLayout, KVPool, LayoutMismatch
from libkv.transfer import (
    BackendMismatch,
    EngineUnavailable,
    PeerUnreachable,
    TransferAborted,
    TransferEndpoint,
    TransferState,
    create_backend,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def make(num_pages=16):
    backend = create_backend("fake", timeout_s=1.0)
    backend.register(KVPool(LAYOUT, num_pages))
    return backend


def test_endpoint_round_trips_as_json():
    ep = make().endpoint()
    assert ep.backend == "fake" and ep.layout == LAYOUT and ep.num_pages == 16
    assert TransferEndpoint.from_json(ep.to_json()) == ep


async def test_write_is_done_and_coalesces_runs():
    sender, receiver = make(), make(num_pages=32)
    peer = sender.connect(receiver.endpoint())
    handle = sender.write(peer, [0, 1, 2, 7, 9], [20, 21, 22, 3, 4], key="room-1")
    assert (handle.num_pages, handle.num_runs, handle.nbytes) == (5, 3, 5 * LAYOUT.page_nbytes)
    assert sender.poll(handle) is TransferState.DONE
    await sender.wait(handle)
    sender.wait_blocking(handle)
    assert sender.abort(handle) is TransferState.DONE  # already finished: abort changes nothing
    assert (sender.writes, sender.runs_written) == (1, 3)
    assert sender._transfers == {}  # finished writes leave the table; the handle keeps its record
    other = make()
    with pytest.raises(KeyError):
        other.poll(handle)


def test_pages_are_checked_against_both_pools():
    sender, receiver = make(num_pages=8), make(num_pages=4)
    peer = sender.connect(receiver.endpoint())
    with pytest.raises(IndexError, match="destination"):
        sender.write(peer, [0], [4])
    with pytest.raises(IndexError, match="source"):
        sender.write(peer, [8], [0])
    with pytest.raises(ValueError, match="repeat"):
        sender.write(peer, [0, 1], [2, 2])
    with pytest.raises(ValueError):
        sender.write(peer, [0, 1], [2])


def test_connect_refuses_other_layout_and_backend_naming_both():
    sender = make()
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=8, dtype="bfloat16")
    theirs = create_backend("fake")
    theirs.register(KVPool(other, 4))
    with pytest.raises(LayoutMismatch) as err:
        sender.connect(theirs.endpoint())
    assert "page_size: 4 vs 8" in str(err.value) and "dtype: float32 vs bfloat16" in str(err.value)
    ep = make().endpoint()
    with pytest.raises(BackendMismatch, match="fake vs nixl"):
        sender.connect(TransferEndpoint("nixl", ep.layout, ep.host, ep.num_pages, ep.blob))


def test_unknown_peer_disconnect_and_close():
    sender, receiver = make(), make()
    with pytest.raises(PeerUnreachable):
        sender.write("nobody", [0], [0])
    peer = sender.connect(receiver.endpoint())
    sender.disconnect(peer)
    with pytest.raises(PeerUnreachable):
        sender.write(peer, [0], [0])
    peer = sender.connect(receiver.endpoint())
    sender.close()
    with pytest.raises(TransferAborted):
        sender.write(peer, [0], [0])


def test_expectations_accumulate_and_release():
    receiver = make()
    receiver.expect("room", [1, 2])
    receiver.expect("room", [5])
    assert receiver.expected_pages("room") == {1, 2, 5}
    with pytest.raises(IndexError):
        receiver.expect("room", [16])
    receiver.release_expectation("room")
    receiver.release_expectation("room")  # idempotent
    assert receiver.expected_pages("room") == frozenset()


def test_register_once_and_required():
    backend = create_backend("fake")
    with pytest.raises(RuntimeError, match="register"):
        backend.endpoint()
    backend.register(KVPool(LAYOUT, 2))
    with pytest.raises(RuntimeError, match="already"):
        backend.register(KVPool(LAYOUT, 2))


def test_unknown_backend_and_missing_engine_name_the_package(monkeypatch):
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_backend("carrier-pigeon")
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes the import fail
    with pytest.raises(EngineUnavailable, match="mooncake-transfer-engine-non-cuda"):
        create_backend("mooncake")


def test_importing_backends_loads_no_engine():
    code = ("import sys, libkv.transfer, libkv.transfer.mooncake, libkv.transfer.nixl, libkv.transfer.ucx;"
            "print(sorted(m for m in ('mooncake', 'nixl_cu12', 'ucxx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "[]"


def test_writes_from_many_threads_get_distinct_handles():
    from concurrent.futures import ThreadPoolExecutor

    sender, receiver = make(), make()
    peer = sender.connect(receiver.endpoint())

    def write_and_wait(i: int) -> int:
        handle = sender.write(peer, [i % 16], [(i * 7) % 16], key=f"room-{i}")
        sender.wait_blocking(handle)
        assert sender.abort(handle) is TransferState.DONE
        return handle.transfer_id

    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(write_and_wait, range(400)))
    assert len(set(ids)) == 400 and sender.writes == 400
