"""The names of the KV transfer backends, declared once. Torch-free, so a launcher that starts
workers (`pdserve up`) offers the same choices as the worker's flag without importing libkv; the
classes behind the names are libkv.transfer's (its BACKENDS), which a test keeps in step with these.
"""

from __future__ import annotations

# Every backend a worker may run (--disaggregation-transfer-backend). Real engines first; `fake`
# moves nothing (control-plane tests only).
BACKEND_NAMES = ("mooncake", "nixl", "ucx", "fake")
# The engines that move bytes.
REAL_BACKENDS = tuple(name for name in BACKEND_NAMES if name != "fake")
# The real engines whose writes land without the receiver taking part (`one_sided` on the class):
# the receiver learns that bytes arrived only from the control plane and the landing checksums.
# EPD's encoders write image embeddings over these only (--encoder-transfer-backend): the worker
# poisons its pages and waits until they hash to the encoder's checksums (services/worker/encoders.py).
ONE_SIDED_BACKENDS = ("mooncake", "nixl")
