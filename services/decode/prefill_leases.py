"""Decode's view of the prefill workers' registry leases: who is registered at each address, and the
Prefill calls to cancel when a prefill's lease expires.

A prefill whose lease expired stopped heartbeating (hung or partitioned): its open Prefill calls
fail at once instead of waiting out their deadline (the request then fails over and its pages go
to the quarantine, remote_prefill.py). Other departures (deregistered, replaced, registry
unreachable) leave calls alone: the connection itself tells if it is dead.

A prefill's identity is its registry worker id, not its address: a process restarted on the same
port is a new worker. Calls are matched by worker id (DecodeRoom.prefill_id), so the late lease
expiry of a killed prefill never fails the calls of the new process that took its address
meanwhile; and a new worker id at an address drops decode's channel to it
(PrefillClients.forget): nothing of the old process is reused.
"""

from __future__ import annotations

import logging

from protos.v1 import bootstrap_pb2, common_pb2
from services.common.registry_client import RegistryClient
from services.decode.remote_prefill import RemotePrefill

log = logging.getLogger("pdserve.decode")


async def watch_prefill_leases(registry: RegistryClient, remote: RemotePrefill) -> None:
    """Follow the prefill workers' registry events for as long as the worker runs (a task)."""
    ids = remote.prefill_ids
    async for event in registry.watch(role=common_pb2.WORKER_ROLE_PREFILL):
        worker = event.worker
        address, worker_id = worker.grpc_address, worker.worker_id
        if event.type == bootstrap_pb2.WORKER_EVENT_TYPE_JOINED:
            known = ids.get(address)
            ids[address] = worker_id
            if known is not None and known != worker_id:
                log.info("prefill %s is a new process (%s, was %s): new channel", address, worker_id, known)
                remote.prefills.forget(address)
        elif event.type == bootstrap_pb2.WORKER_EVENT_TYPE_LEFT:
            current = ids.get(address)
            if current == worker_id:
                del ids[address]
            if event.reason == "lease expired":
                cancel_calls_of(remote, address, worker_id, current)


def cancel_calls_of(remote: RemotePrefill, address: str, worker_id: str, current: str | None) -> None:
    """Cancel the open Prefill calls that went to `worker_id` at `address`. A call sent before decode
    learnt who is there is that worker's unless another one registered at the address since."""
    for room in remote.rooms.rooms():
        call = room.call
        if call is None or room.prefill_address != address or call.done():
            continue
        if room.prefill_id == worker_id or (not room.prefill_id and current in (None, worker_id)):
            room.lost = f"stopped heartbeating (registry lease of {worker_id} expired)"
            call.cancel()
