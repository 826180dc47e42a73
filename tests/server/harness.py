"""Moved to `sas_backend.server_harness`; this name stays only for tests/gpu/test_server_gpu.py."""

from sas_backend.server_harness import Server, complete  # noqa: F401
