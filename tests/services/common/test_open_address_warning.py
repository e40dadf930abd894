"""A registry or worker bound to an address other hosts can reach, with no cluster secret, says so
loudly at start (and how to set one); on loopback, or with a secret, it says nothing."""

from __future__ import annotations

import logging

import pytest

from services.common.security import GrpcSecurity


@pytest.mark.parametrize(("host", "secret", "warned"), [
    ("0.0.0.0", None, True), ("10.0.0.5", None, True), ("worker-1.cluster", None, True), ("::", None, True),
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("0.0.0.0", "s3cret", False),
])
def test_an_open_address_without_a_secret_is_named(tmp_path, caplog, host, secret, warned):
    secret_file = None
    if secret:
        secret_file = tmp_path / "secret"
        secret_file.write_text(secret)
    security = GrpcSecurity(cluster_secret_file=str(secret_file) if secret_file else None)
    with caplog.at_level(logging.WARNING, logger="pdserve.security"):
        security.warn_if_open(host, "this decode worker")
    text = caplog.text
    assert (f"this decode worker listens on {host} without a cluster secret" in text) is warned
    if warned:
        assert "--cluster-secret-file FILE or PDSERVE_CLUSTER_SECRET" in text
