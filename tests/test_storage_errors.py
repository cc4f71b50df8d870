"""Unreachable storage and bad configuration fail at open with one clear error."""
from __future__ import annotations

import socket

import pytest

from storage import FingerprintError, SnapshotStore, StorageConfigError, StorageUnavailableError, errors


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.s3
@pytest.mark.timeout(120)  # only bounds a hang: one refused connection, no retries
def test_an_unreachable_s3_endpoint_fails_at_open_naming_the_root():
    options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{closed_port()}",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(StorageUnavailableError, match=r"^s3://bucket/job: .*unreachable.*check the endpoint URL"):
        SnapshotStore.open("s3://bucket/job", options)


@pytest.mark.s3
def test_a_missing_bucket_fails_at_open_and_says_to_create_it(s3_server):
    with pytest.raises(StorageUnavailableError, match=r"s3://no-such-bucket-here/job: the bucket does not exist.*create it"):
        SnapshotStore.open("s3://no-such-bucket-here/job", s3_server.storage_options)


@pytest.mark.s3
def test_an_unknown_storage_option_is_a_configuration_error(s3_server):
    with pytest.raises(StorageConfigError, match="storage options"):
        SnapshotStore.open("s3://bucket/job", {**s3_server.storage_options, "no_such_option": 1})


def test_an_unknown_protocol_is_a_configuration_error():
    with pytest.raises(StorageConfigError, match="nosuchproto://x: cannot build a file system"):
        SnapshotStore.open("nosuchproto://x")


def test_a_fingerprint_without_name_or_parallelism_is_refused(memory_root):
    store = SnapshotStore.open(memory_root)
    with pytest.raises(FingerprintError, match="job_name"):
        store.init_job({"max_parallelism": 4})
    with pytest.raises(FingerprintError, match="max_parallelism"):
        store.init_job({"job_name": "j", "max_parallelism": 0})
    with pytest.raises(FingerprintError, match="JSON"):
        store.init_job({"job_name": "j", "max_parallelism": 4, "ops": object()})
    assert store.read_job() is None


def test_every_storage_error_documents_cause_and_remedy():
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(c, errors.StorageError) for c in classes)
    for cls in classes:
        doc = cls.__doc__ or ""
        assert len(doc.split()) >= 8, f"{cls.__name__} needs a docstring with cause and remedy"
        if cls is not errors.StorageError:
            assert "Remedy:" in doc, f"{cls.__name__} must state the remedy"
