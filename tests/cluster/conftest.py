"""The server tests' fixtures (a tiny model on disk, fake engines) for the cluster's tests."""

from tests.server.conftest import fake_engine, tiny_model_dir  # noqa: F401
