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


@pytest.mark.s3
@pytest.mark.parametrize("bad", [{"endpoint_url": "127.0.0.1:9000"}, {"config_kwargs": '{"retries":'},
                                 {"client_kwargs": "region_name=x"}])
def test_a_malformed_s3_option_is_a_configuration_error_naming_the_root(s3_server, s3_bucket, bad, capsys):
    """An endpoint_url without its scheme (botocore: ValueError) or a config_kwargs/client_kwargs
    that is not a mapping (s3fs: AttributeError, e.g. -o JSON that did not parse and stayed a
    string) is a StorageConfigError naming the root, as the other rejected options are: the CLI
    called it a bug (exit 3) or a data problem (exit 1, no root), abs.run retried it as transient."""
    from abs.cli import main

    url = f"s3://{s3_bucket}/job"
    with pytest.raises(StorageConfigError, match=rf"^{url}: the storage options were rejected .*fix them"):
        SnapshotStore.open(url, {**s3_server.storage_options, **bad})
    ((name, value),) = bad.items()
    opts = ["-o", f"key={s3_server.storage_options['key']}", "-o", f"secret={s3_server.storage_options['secret']}",
            "-o", f"endpoint_url={s3_server.endpoint_url}", "-o", f"{name}={value}"]
    assert main(["ls", url, *opts]) == 2
    err = capsys.readouterr().err
    assert f"{url}: the storage options were rejected" in err and "bug" not in err


@pytest.mark.parametrize("url", ["{tmp}/root", "file://{tmp}/root"])
def test_storage_options_on_a_local_root_are_refused_naming_them_not_ignored(url, tmp_path):
    """A local root takes no storage options (plain file calls): anon=true meant for S3, or a
    misspelt key, is a configuration error naming the options, not silently dropped."""
    url = url.format(tmp=tmp_path)
    with pytest.raises(StorageConfigError, match=r"unknown storage option\(s\) 'anon', 'endpoint_ulr' for a local "
                       r"root; a local root \(a path or file:// URL\) takes no storage options: they apply to "
                       r"remote URLs such as s3://"):
        SnapshotStore.open(url, {"anon": True, "endpoint_ulr": "http://x"})
    assert not (tmp_path / "root").exists()
    SnapshotStore.open(url, {}).init_job({"job_name": "j", "max_parallelism": 4})  # none (or {}) is fine


def test_storage_options_on_a_local_root_fail_abs_run_and_the_cli_at_once(tmp_path, capsys):
    import pyarrow as pa

    import abs
    from abs.cli import main

    flow = abs.Dataflow("local-options")
    flow.source("s", abs.GeneratorSource(10, num_keys=2)).key_by("key").process(
        "p", lambda ctx, r: ctx.emit(r), state=[abs.ValueState("n", pa.int64())]).sink("o", abs.CollectSink())
    with pytest.raises(StorageConfigError, match="'anon' for a local root"):
        abs.run(flow, parallelism=1, storage=str(tmp_path / "snap"), storage_options={"anon": True},
                restart=abs.RestartStrategy(max_restarts=3, delay=0.1))
    assert main(["ls", str(tmp_path / "snap"), "-o", "anon=true"]) == 2
    err = capsys.readouterr().err
    assert "unknown storage option(s) 'anon' for a local root" in err and "Traceback" not in err


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
