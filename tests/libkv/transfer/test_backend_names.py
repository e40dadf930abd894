"""The transfer backend names, declared once (pdserve/transfer_backends.py): each names libkv's
backend class of that name, and the subsets say what their classes say (bytes moved, one-sided
writes)."""

from __future__ import annotations

from libkv.transfer import BACKEND_NAMES, BACKENDS, ONE_SIDED_BACKENDS, REAL_BACKENDS, backend_class
from services.worker.config import BACKENDS as WORKER_BACKENDS
from services.worker.epd_config import ENCODER_BACKENDS
from tools.chaos.config import BACKENDS as CHAOS_BACKENDS
from tools.up import BACKENDS as UP_BACKENDS


def test_each_name_is_its_backend_class_name():
    assert BACKEND_NAMES == tuple(BACKENDS) == ("mooncake", "nixl", "ucx", "fake")
    assert all(backend_class(name).name == name for name in BACKEND_NAMES)


def test_the_subsets_are_what_the_classes_say():
    assert REAL_BACKENDS == tuple(name for name in BACKEND_NAMES if backend_class(name).moves_bytes)
    assert ONE_SIDED_BACKENDS == tuple(name for name in REAL_BACKENDS if backend_class(name).one_sided)


def test_every_flag_offers_the_declared_names():
    assert (WORKER_BACKENDS is BACKEND_NAMES and CHAOS_BACKENDS is BACKEND_NAMES
            and UP_BACKENDS is BACKEND_NAMES)
    assert ENCODER_BACKENDS is ONE_SIDED_BACKENDS
