"""The transfer peer harness, for tests and benchmarks only: one transfer backend hosted in a
child process (worker.py, `python -m tools.transfer_peer.worker`) and driven over its pipes by
client.PeerProcess. Transfer engines need two processes for a transfer, and NIXL and UCX crash at
interpreter exit, so never run inside pytest. Used by tests/libkv/transfer and `pdserve bench
transfer` (tools/bench/transfer.py)."""
