"""WorkerInfo builders shared by the bootstrap tests."""

from __future__ import annotations

from protos.v1 import bootstrap_pb2, common_pb2


def kv_layout(page_size: int = 16, dtype: str = "float32", num_layers: int = 2) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(num_layers=num_layers, num_kv_heads=2, head_dim=64, page_size=page_size,
                               dtype=dtype)


def worker_info(grpc_address: str = "127.0.0.1:5000", role: int = common_pb2.WORKER_ROLE_PREFILL,
                model: str = "tiny", backend: str = "fake", **layout_args) -> bootstrap_pb2.WorkerInfo:
    layout = kv_layout(**layout_args)
    return bootstrap_pb2.WorkerInfo(
        role=role, model=model, kv_layout=layout, grpc_address=grpc_address,
        metrics_address="127.0.0.1:9000",
        transfer_endpoint=common_pb2.TransferEndpoint(backend=backend, host="127.0.0.1", layout=layout,
                                                      descriptor=b"\x00opaque"))
