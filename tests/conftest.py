"""Shared, generic pytest fixtures.

- ``s3_server`` (session): a real S3 API server (moto) on 127.0.0.1, with the storage options
  s3fs needs to talk to it (dummy credentials, ``endpoint_url``, one quick retry).
- ``s3_bucket`` (session): one bucket on that server, shared by the tests of a run.
- ``s3_root``: a fresh, unique ``s3://<bucket>/<prefix>`` URL for one test (creating a bucket
  per test costs 0.2-0.6 s on moto; a prefix costs nothing).
- ``memory_root``: a unique ``memory://`` root (fsspec's memory file system is process-global),
  removed after the test.

And, for the whole run, the ``faulty://`` protocol (``storage.testing``) in this process and in
every process it starts (see ``pytest_configure``).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """``faulty://`` for the tests: registered here, and for the processes the tests start
    (a job's workers, CLI subprocesses) through a plugin directory on ``sys.path`` (workers
    inherit the driver's) and ``PYTHONPATH`` whose entry point fsspec reads when it is
    imported (see ``storage.testing.register_faulty_protocol``)."""
    from storage.testing import register_faulty_protocol

    plugin_dir = register_faulty_protocol(tempfile.mkdtemp(prefix="abs-test-fsspec-"))
    assert plugin_dir is not None
    config._abs_faulty_plugin_dir = plugin_dir  # type: ignore[attr-defined]
    sys.path.append(plugin_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), plugin_dir) if p)


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin_dir = getattr(config, "_abs_faulty_plugin_dir", None)
    if plugin_dir is not None:
        shutil.rmtree(plugin_dir, ignore_errors=True)


@dataclass(frozen=True)
class S3Server:
    """Where the loopback S3 server listens and how to reach it through fsspec/s3fs."""

    endpoint_url: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def filesystem(self) -> Any:
        import fsspec

        return fsspec.filesystem("s3", skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        options = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": endpoint,
            "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 2},
        }
        yield S3Server(endpoint_url=endpoint, storage_options=options)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server) -> str:
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.filesystem().mkdir(name)
    return name


@pytest.fixture
def s3_root(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def memory_root() -> Iterator[str]:
    import fsspec

    name = f"/test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local Spark session (``local[4]``: four task slots for barrier stages, no UI, 2 shuffle partitions), created only when a
    test asks for it and shared by the whole run; stopped at the end."""
    import os
    import sys

    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    session = (
        SparkSession.builder.master("local[4]")
        .appName("abs-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()
