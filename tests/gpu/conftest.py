"""The e2e fixtures (checkpoint, cluster with its logs printed on failure) for the PD part."""

from tests.e2e.conftest import cluster, pytest_runtest_makereport, tiny_model  # noqa: F401
