"""The connectors' one copy of the file-system helpers (abs.connectors.fs): the store contract
the file sink and the replayable batch log both write through, on local disk, memory and S3
(moto on loopback).

Before the helpers were one module, the file sink wrote a pending file in place (a failure
part-way left a truncated file under the target's name) while the batch log wrote a temporary
file and renamed it (without making the rename durable). The one copy does both: temporary
file, fsync, rename, fsync of the directory; these tests pin the behaviour that diverged.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pytest
from fsspec.implementations.local import LocalFileSystem
from hypothesis import given
from hypothesis import strategies as st

from abs.connectors.batchlog import _Log
from abs.connectors.file_sink import FileSink, read_output
from abs.connectors.fs import Files, is_local, temp_target


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def place(request: Any, tmp_path: Any) -> Iterator[tuple[Files, str]]:
    """``(Files, directory)`` on one file system kind."""
    if request.param == "local":
        yield Files(fsspec.filesystem("file")), str(tmp_path / "dir")
    elif request.param == "memory":
        root = request.getfixturevalue("memory_root")
        fs, path = fsspec.core.url_to_fs(root)
        yield Files(fs), path
    else:
        server = request.getfixturevalue("s3_server")
        root = request.getfixturevalue("s3_root")
        fs = server.filesystem()
        yield Files(fs), root.removeprefix("s3://")


class Unwritable:
    """Data whose write fails part-way through ``put`` (after the target would have been
    opened for writing): not a bytes-like object."""


def test_a_local_put_that_fails_part_way_leaves_the_previous_file_whole_and_no_temporary_file(tmp_path):
    files = Files(fsspec.filesystem("file"))
    target = str(tmp_path / "out" / "part.bin")
    files.put(target, b"previous content")
    with pytest.raises(TypeError):
        files.put(target, Unwritable())  # type: ignore[arg-type]
    assert files.read(target) == b"previous content"
    assert os.listdir(tmp_path / "out") == ["part.bin"]


def test_put_replaces_the_whole_file_creates_parents_and_leaves_only_the_target(place):
    files, directory = place
    target = f"{directory}/a/b/file.json"
    files.put(target, b"first, longer content")
    files.put(target, b"second")
    assert files.read(target) == b"second"
    files.refresh(f"{directory}/a/b")
    assert files.list_files(f"{directory}/a/b") == ["file.json"]
    assert files.list_names(f"{directory}/a") == ["b"]


def test_create_writes_once_and_never_replaces(place):
    files, directory = place
    target = f"{directory}/batch-000000000000.json"
    assert files.create(target, b"one")
    assert not files.create(target, b"two")
    assert files.read(target) == b"one"
    files.refresh(directory)
    assert files.list_files(directory) == ["batch-000000000000.json"]


def test_reads_listings_and_deletes_of_missing_things_are_empty_not_errors(place):
    files, directory = place
    assert files.read(f"{directory}/none") is None
    assert files.read_json(f"{directory}/none.json") is None
    assert files.list_files(f"{directory}/nowhere") == []
    assert files.list_names(f"{directory}/nowhere") == []
    files.delete(f"{directory}/none")
    files.delete(f"{directory}/nowhere", recursive=True)


class _OnlyLocal(LocalFileSystem):
    protocol = "local"


class _OnlyFile(LocalFileSystem):
    protocol = "file"


def test_either_name_of_the_local_file_system_counts_as_local():
    assert is_local(fsspec.filesystem("file"))
    assert is_local(_OnlyLocal(skip_instance_cache=True))
    assert is_local(_OnlyFile(skip_instance_cache=True))
    assert not is_local(fsspec.filesystem("memory"))


@given(st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=40))
def test_a_temporary_file_name_gives_back_its_target_and_no_other_name_does(name):
    assert temp_target(f".tmp-{uuid.uuid4().hex}-{name}") == name
    if not name.startswith(".tmp-"):
        assert temp_target(name) is None


def test_the_batch_log_writes_through_the_same_contract(tmp_path):
    log = _Log(str(tmp_path / "log"), None)
    log.put(log.path("_end.json"), b'{"batches": 1}')
    with pytest.raises(TypeError):
        log.put(log.path("_end.json"), Unwritable())  # type: ignore[arg-type]
    assert log.read_json(log.path("_end.json")) == {"batches": 1}
    assert log.create(log.path("batch-000000000000.json"), b"{}")
    assert not log.create(log.path("batch-000000000000.json"), b"[]")
    assert sorted(log.names()) == ["_end.json", "batch-000000000000.json"]


def test_a_restarted_sink_writer_removes_the_temporary_pending_files_of_its_subtasks_only(tmp_path):
    """What a process killed while writing a pending file leaves behind: a temporary file in
    ``_pending/``. The writer that owns the subtask removes it at start; others leave it."""
    out = tmp_path / "out"
    sink = FileSink(str(out), format="jsonl")
    writer = sink.create_writer(0, 2)
    writer.write(pa.record_batch({"v": [1, 2]}))
    handle = writer.pre_commit(1)
    writer.commit(1, [handle])
    pending = out / "_pending"
    leftovers = {
        subtask: f".tmp-{uuid.uuid4().hex}-part-00000002-{subtask:03d}-{uuid.uuid4().hex}.jsonl" for subtask in (0, 1)
    }
    for name in leftovers.values():
        (pending / name).write_bytes(b'{"v": 3}\n{"v"')  # cut short
    sink.create_writer(0, 2, restored_transactions=[handle])
    assert sorted(os.listdir(pending)) == [leftovers[1]]
    sink.create_writer(1, 2, restored_transactions=[handle])
    assert os.listdir(pending) == []
    assert read_output(str(out), "jsonl").column("v").to_pylist() == [1, 2]


@pytest.mark.integration
def test_a_sink_that_cannot_write_fails_the_job_naming_the_sink_and_its_destination(s3_server, tmp_path):
    """A FileSink into a bucket that does not exist, chained behind its source: the error names
    the sink's uid and destination (it named the source at the head of the task, and ended in
    the file system's traceback alone)."""
    import abs

    flow = abs.Dataflow("sink-error")
    flow.source("src", abs.GeneratorSource(1_000, num_keys=10)).sink(
        "out", FileSink(f"s3://missing-{uuid.uuid4().hex[:12]}/out", storage_options=s3_server.storage_options))
    with pytest.raises(abs.OperatorError) as err:
        abs.run(flow, parallelism=1, storage=str(tmp_path / "root"))
    text = str(err.value)
    assert "operator 'out' failed" in text and "operator 'src'" not in text, text
    assert "the sink writer of FileSink('s3://missing-" in text and "pre_commit of checkpoint" in text, text
    assert "bucket does not exist" in text, text
