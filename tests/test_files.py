"""FileSource and FileSink, driven the way the runtime drives them: readers polled with
offsets taken at "barriers", writers pre-committed at barriers and committed on checkpoint
completion, crashes simulated by dropping objects and re-creating them from stored
offsets / transaction handles."""
from __future__ import annotations

import json
import pickle
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import abs.connectors.file_source as file_source
from abs.connectors.file_sink import FileSink, FileSinkError, read_output
from abs.connectors.file_source import FileSource, FileSourceError, NoFilesMatchedWarning
from abs.connectors.fs import Files
from abs.errors import ConfigError
from abs.connectors.sources import END

MEM = fsspec.filesystem("memory")


# --------------------------------------------------------------------------- helpers


def unique_memory_root(tag: str) -> str:
    return f"memory://test-files-{tag}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def mem_root() -> Iterator[str]:
    root = unique_memory_root("t")
    yield root
    if MEM.exists(mem_path(root)):
        MEM.rm(mem_path(root), recursive=True)


def mem_path(url: str) -> str:
    """The memory file system's own name for a ``memory://`` URL."""
    return url.removeprefix("memory:/")


def poll_batches(reader: Any, limit: int | None = None) -> tuple[list[pa.RecordBatch], bool]:
    """Poll up to ``limit`` batches (all if None); returns (batches, reached END)."""
    out: list[pa.RecordBatch] = []
    while limit is None or len(out) < limit:
        batch = reader.poll()
        if batch is END:
            return out, True
        assert batch is not None, "file readers never return None"
        out.append(batch)
    return out, False


def read_everything(source: FileSource, offsets: dict[str, Any] | None = None) -> list[pa.RecordBatch]:
    if offsets is None:
        offsets = {s: source.initial_offset(s) for s in source.splits()}
    reader = source.create_reader(offsets, 0, 1)
    batches, ended = poll_batches(reader)
    assert ended and reader.poll() is END  # END is sticky
    reader.close()
    return batches


def rows(batches: list[pa.RecordBatch]) -> list[dict[str, Any]]:
    return [row for b in batches for row in b.to_pylist()]


# --------------------------------------------------------------------------- text source


@dataclass
class TextFile:
    """A generated text file and, per line, the decoded text and the byte offset after it."""

    data: bytes
    lines: list[str]
    ends: list[int]


LINE_CHARS = st.sampled_from(["a", "Z", " ", "\t", "é", "€", "😀", "中", "\r"])


@st.composite
def text_files(draw: Any) -> TextFile:
    """Lines (multi-byte UTF-8, empty lines, stray CRs inside a line) each ended by LF or
    CRLF; the last one maybe without terminator."""
    raw = draw(
        st.lists(
            st.tuples(st.text(LINE_CHARS, max_size=5).map(lambda s: s.rstrip("\r")), st.sampled_from(["\n", "\r\n"])),
            max_size=9,
        )
    )
    trailing = draw(st.booleans())
    data, lines, ends = b"", [], []
    for i, (text, term) in enumerate(raw):
        last = i == len(raw) - 1
        chunk = (text + ("" if last and not trailing else term)).encode("utf-8")
        if not chunk:
            continue  # an empty unterminated last line is no line
        data += chunk
        lines.append(text)
        ends.append(len(data))
    return TextFile(data, lines, ends)


def write_text_files(root: str, contents: list[TextFile]) -> list[str]:
    names = [f"f{i:02d}.txt" for i in range(len(contents))]
    for name, content in zip(names, contents):
        MEM.pipe_file(f"{mem_path(root)}/in/{name}", content.data)
    return names


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    contents=st.lists(text_files(), min_size=1, max_size=3),
    segments=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), max_size=4),
    last_batch_size=st.integers(1, 6),
    chunk=st.sampled_from([1, 2, 5, 1 << 20]),
)
def test_text_source_resumes_exactly_at_stored_byte_offsets(
    contents: list[TextFile], segments: list[tuple[int, int]], last_batch_size: int, chunk: int
) -> None:
    root = unique_memory_root("text")
    saved_chunk = file_source._READ_CHUNK
    file_source._READ_CHUNK = chunk  # also exercise lines that span read chunks
    try:
        names = write_text_files(root, contents)
        expected = [{"line": line, "file": n} for n, c in zip(names, contents) for line in c.lines]
        glob = f"{root}/in/*.txt"
        assert FileSource(glob).splits() == names

        offsets = {n: 0 for n in names}
        got: list[dict[str, Any]] = []
        for batch_size, k in segments:  # read k batches, take offsets at a barrier, "crash"
            reader = FileSource(glob, batch_size=batch_size).create_reader(offsets, 0, 1)
            batches, _ = poll_batches(reader, k)
            assert all(b.num_rows <= batch_size for b in batches)
            got += rows(batches)
            offsets = reader.offsets()
            json.dumps(offsets)  # offsets are JSON values
            # the offset is the byte offset just after the last line read from each file
            for n, c in zip(names, contents):
                done = sum(1 for r in got if r["file"] == n)
                assert offsets[n] == (c.ends[done - 1] if done else 0)
        got += rows(read_everything(FileSource(glob, batch_size=last_batch_size), offsets))
        assert got == expected
    finally:
        file_source._READ_CHUNK = saved_chunk
        MEM.rm(mem_path(root), recursive=True)


def test_text_lines_keep_empty_lines_strip_crlf_and_bom(mem_root: str) -> None:
    MEM.pipe_file(f"{mem_path(mem_root)}/a.txt", "\ufeffone\r\n\r\n\ntwo\rx\nlast é".encode())
    MEM.pipe_file(f"{mem_path(mem_root)}/b.txt", b"")
    MEM.pipe_file(f"{mem_path(mem_root)}/c.txt", b"\n")
    source = FileSource(f"{mem_root}/*.txt", batch_size=100)
    assert rows(read_everything(source)) == [
        {"line": "one", "file": "a.txt"},
        {"line": "", "file": "a.txt"},
        {"line": "", "file": "a.txt"},
        {"line": "two\rx", "file": "a.txt"},
        {"line": "last é", "file": "a.txt"},
        {"line": "", "file": "c.txt"},
    ]


def test_text_source_reads_local_paths_and_file_urls(tmp_path: Any) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.log").write_bytes(b"1\n2\n")
    (tmp_path / "d" / "y.log").write_bytes(b"3")
    expected = [{"line": "1", "file": "x.log"}, {"line": "2", "file": "x.log"}, {"line": "3", "file": "y.log"}]
    for glob in (f"{tmp_path}/d/*.log", f"file://{tmp_path}/d/*.log"):
        assert rows(read_everything(FileSource(glob, batch_size=1))) == expected
    # a path without wildcards names one file
    assert rows(read_everything(FileSource(f"{tmp_path}/d/y.log"))) == [{"line": "3", "file": "y.log"}]


def test_text_columns_option_selects_line_only(mem_root: str) -> None:
    MEM.pipe_file(f"{mem_path(mem_root)}/a.txt", b"x\ny\n")
    batches = read_everything(FileSource(f"{mem_root}/*.txt", columns=["line"]))
    assert batches[0].schema == pa.schema([("line", pa.string())])
    with pytest.raises(ConfigError, match="text columns"):
        FileSource(f"{mem_root}/*.txt", columns=["nope"])


def test_split_ids_are_relative_sorted_and_skip_hidden_paths(mem_root: str) -> None:
    base = mem_path(mem_root)
    for p in ["b/2.txt", "a.txt", "b/1.txt", "b/c/3.txt", "_pending/p.txt", "b/.x.txt", "b/_SUCCESS", ".hidden/h.txt"]:
        MEM.pipe_file(f"{base}/{p}", b"x\n")
    assert FileSource(f"{mem_root}/**").splits() == ["a.txt", "b/1.txt", "b/2.txt", "b/c/3.txt"]
    assert FileSource(f"{mem_root}/b/*.txt").splits() == ["1.txt", "2.txt"]
    assert FileSource(f"{mem_root}/*/*.txt").splits() == ["b/1.txt", "b/2.txt"]
    with pytest.raises(ConfigError, match="is a directory"):
        FileSource(f"{mem_root}/b").splits()


def test_glob_matching_nothing_gives_zero_splits_and_warns(mem_root: str) -> None:
    source = FileSource(f"{mem_root}/nothing/*.txt")
    with pytest.warns(NoFilesMatchedWarning, match="matched no file"):
        assert source.splits() == []
    assert source.create_reader({}, 0, 1).poll() is END


def test_splits_partitioned_over_readers_cover_every_file_once(mem_root: str) -> None:
    for i in range(7):
        MEM.pipe_file(f"{mem_path(mem_root)}/in/{i}.txt", "".join(f"{i}-{j}\n" for j in range(i)).encode())
    source = pickle.loads(pickle.dumps(FileSource(f"{mem_root}/in/*.txt", batch_size=2)))
    splits = source.splits()
    parallelism = 3
    seen_files: list[set[str]] = []
    all_rows: list[dict[str, Any]] = []
    for subtask in range(parallelism):
        mine = splits[subtask::parallelism]
        reader = source.create_reader({s: source.initial_offset(s) for s in mine}, subtask, parallelism)
        got = rows(poll_batches(reader)[0])
        assert {r["file"] for r in got} <= set(mine)
        seen_files.append({r["file"] for r in got})
        all_rows += got
    assert set.union(*seen_files) == {f"{i}.txt" for i in range(1, 7)}  # 0.txt is empty
    assert sum(len(s) for s in seen_files) == len(set.union(*seen_files))
    assert sorted(r["line"] for r in all_rows) == sorted(f"{i}-{j}" for i in range(7) for j in range(i))


def test_vanished_file_error_names_the_file(mem_root: str) -> None:
    MEM.pipe_file(f"{mem_path(mem_root)}/a.txt", b"x\n")
    source = FileSource(f"{mem_root}/*.txt")
    splits = source.splits()
    MEM.rm(f"{mem_path(mem_root)}/a.txt")
    reader = source.create_reader({s: 0 for s in splits}, 0, 1)
    with pytest.raises(FileSourceError, match=r"a\.txt.*is gone.*Restore it"):
        reader.poll()


@pytest.mark.parametrize(
    ("data", "offset", "message"),
    [
        (b"abc\ndef\n", 100, "shorter than the restored offset"),
        (b"abc\ndef\n", 2, "not at a line start"),
        (b"ok\n\xff\xfe\n", 0, "not valid UTF-8"),
    ],
)
def test_text_source_rejects_changed_or_invalid_files(mem_root: str, data: bytes, offset: int, message: str) -> None:
    MEM.pipe_file(f"{mem_path(mem_root)}/a.txt", data)
    reader = FileSource(f"{mem_root}/*.txt").create_reader({"a.txt": offset}, 0, 1)
    with pytest.raises(FileSourceError, match=message) as info:
        reader.poll()
    assert "a.txt" in str(info.value)


def test_offsets_must_be_non_negative_integers(mem_root: str) -> None:
    with pytest.raises(FileSourceError, match="non-negative integer"):
        FileSource(f"{mem_root}/*.txt").create_reader({"a.txt": "3"}, 0, 1)


def test_finished_split_keeps_its_end_offset_and_is_not_reread(mem_root: str) -> None:
    MEM.pipe_file(f"{mem_path(mem_root)}/a.txt", b"x\ny")
    source = FileSource(f"{mem_root}/*.txt")
    reader = source.create_reader({"a.txt": 0}, 0, 1)
    poll_batches(reader)
    assert reader.offsets() == {"a.txt": 3}
    assert read_everything(source, reader.offsets()) == []


# --------------------------------------------------------------------------- parquet source


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.tuples(st.integers(0, 25), st.integers(1, 7)), min_size=1, max_size=3),
    segments=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4)), max_size=4),
    last_batch_size=st.integers(1, 8),
)
def test_parquet_source_resumes_exactly_at_stored_row_offsets(
    sizes: list[tuple[int, int]], segments: list[tuple[int, int]], last_batch_size: int
) -> None:
    root = unique_memory_root("pq")
    try:
        expected: list[dict[str, Any]] = []
        for f, (n, row_group_size) in enumerate(sizes):
            ids = pa.array([f * 1000 + i for i in range(n)], pa.int64())
            table = pa.table({"id": ids, "s": [f"é{i}" for i in range(n)]})
            with MEM.open(f"{mem_path(root)}/data/f{f}.parquet", "wb") as out:
                pq.write_table(table, out, row_group_size=row_group_size)
            expected += table.to_pylist()
        glob = f"{root}/data/*.parquet"
        offsets = {s: 0 for s in FileSource(glob, format="parquet").splits()}
        got: list[dict[str, Any]] = []
        for batch_size, k in segments:
            reader = FileSource(glob, format="parquet", batch_size=batch_size).create_reader(offsets, 0, 1)
            batches, _ = poll_batches(reader, k)
            assert all(b.num_rows <= batch_size for b in batches)
            got += rows(batches)
            offsets = reader.offsets()
            for f in range(len(sizes)):  # offset = rows of that file read so far
                assert offsets[f"f{f}.parquet"] == sum(1 for r in got if r["id"] // 1000 == f)
        got += rows(read_everything(FileSource(glob, format="parquet", batch_size=last_batch_size), offsets))
        assert got == expected
    finally:
        MEM.rm(mem_path(root), recursive=True)


def test_parquet_columns_projection_and_errors(mem_root: str) -> None:
    with MEM.open(f"{mem_path(mem_root)}/a.parquet", "wb") as out:
        pq.write_table(pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"]}), out, row_group_size=2)
    glob = f"{mem_root}/*.parquet"
    assert rows(read_everything(FileSource(glob, format="parquet", columns=["b"]), {"a.parquet": 1})) == [
        {"b": "y"},
        {"b": "z"},
    ]
    with pytest.raises(FileSourceError, match=r"a\.parquet has no column\(s\) \['c'\]"):
        FileSource(glob, format="parquet", columns=["c"]).create_reader({"a.parquet": 0}, 0, 1).poll()
    with pytest.raises(FileSourceError, match=r"past its 3 rows"):
        FileSource(glob, format="parquet").create_reader({"a.parquet": 4}, 0, 1).poll()
    MEM.pipe_file(f"{mem_path(mem_root)}/bad.parquet", b"not parquet")
    with pytest.raises(FileSourceError, match=r"bad\.parquet is not a readable parquet file"):
        FileSource(glob, format="parquet").create_reader({"bad.parquet": 0}, 0, 1).poll()


def test_source_rejects_bad_options() -> None:
    with pytest.raises(ConfigError, match="format"):
        FileSource("memory://x/*", format="csv")
    with pytest.raises(ConfigError, match="batch_size"):
        FileSource("memory://x/*", batch_size=0)


# --------------------------------------------------------------------------- sink backends


@dataclass
class Backend:
    """An output directory on one file system, with the raw operations tests need."""

    url: str
    options: dict[str, Any]
    fs: Any
    root: str  # the directory as the fs names it

    def sink(self, format: str) -> FileSink:
        return FileSink(self.url, format=format, storage_options=self.options)

    def names(self, sub: str = "") -> list[str]:
        """Names of the files (not directories) directly in the output directory or ``sub``."""
        self.fs.invalidate_cache()
        try:
            infos = self.fs.ls(f"{self.root}/{sub}".rstrip("/"), detail=True)
        except FileNotFoundError:
            return []
        return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1] for i in infos if i["type"] == "file")

    def pending(self) -> list[str]:
        return self.names("_pending")

    def output(self, format: str) -> pa.Table:
        return read_output(self.url, format, self.options)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[dict[str, Any]]:
    pytest.importorskip("moto.server")
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="abs-files-test")
    yield {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    server.stop()


def make_backend(kind: str, request: Any, tmp_path: Any) -> Iterator[Backend]:
    if kind == "memory":
        url = unique_memory_root("sink")
        yield Backend(url, {}, MEM, mem_path(url))
        if MEM.exists(mem_path(url)):
            MEM.rm(mem_path(url), recursive=True)
    elif kind == "local":
        yield Backend(f"file://{tmp_path}/out", {}, fsspec.filesystem("file"), f"{tmp_path}/out")
    else:
        options = request.getfixturevalue("s3_endpoint")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        root = f"abs-files-test/{uuid.uuid4().hex}/out"
        yield Backend(f"s3://{root}", options, fs, root)


@pytest.fixture(params=["memory", "local"])
def backend(request: Any, tmp_path: Any) -> Iterator[Backend]:
    """The sink suite runs on every file system kind the commit protocol distinguishes:
    rename-based (local disk) and copy-then-delete (memory here; S3 in the s3 tests)."""
    yield from make_backend(request.param, request, tmp_path)


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def any_backend(request: Any, tmp_path: Any) -> Iterator[Backend]:
    yield from make_backend(request.param, request, tmp_path)


@pytest.fixture
def s3_backend(request: Any, tmp_path: Any) -> Iterator[Backend]:
    yield from make_backend("s3", request, tmp_path)


def batch(values: list[int]) -> pa.RecordBatch:
    return pa.record_batch({"v": pa.array(values, pa.int64()), "s": [f"é{v}" for v in values]})


def values(table: pa.Table) -> list[int]:
    return sorted(table.column("v").to_pylist()) if table.num_rows else []


FORMATS = pytest.mark.parametrize("format", ["parquet", "jsonl"])


# --------------------------------------------------------------------------- sink


@FORMATS
def test_output_is_visible_only_after_commit(backend: Backend, format: str) -> None:
    writer = backend.sink(format).create_writer(0, 1)
    writer.write(batch([1, 2]))
    writer.write(pa.Table.from_batches([batch([3])]))
    handle = writer.pre_commit(1)
    assert values(backend.output(format)) == []
    assert backend.names() == []  # nothing visible at the top level
    assert backend.pending() == [handle["file"]]
    assert handle["file"].startswith("part-00000001-000-") and handle["file"].endswith("." + format)
    writer.commit(1, [handle])
    assert values(backend.output(format)) == [1, 2, 3]
    assert backend.pending() == []
    assert handle["file"] in backend.names()
    assert backend.output(format).column("s").to_pylist() == ["é1", "é2", "é3"]


@FORMATS
def test_pre_commit_without_data_returns_none_and_writes_no_file(backend: Backend, format: str) -> None:
    writer = backend.sink(format).create_writer(0, 1)
    assert writer.pre_commit(1) is None
    writer.write(batch([]))
    assert writer.pre_commit(2) is None
    writer.commit(2, [None])
    assert backend.pending() == [] and [n for n in backend.names() if n.startswith("part-")] == []


@FORMATS
def test_crash_after_pre_commit_is_committed_exactly_once_on_restore(backend: Backend, format: str) -> None:
    sink = backend.sink(format)
    writer = sink.create_writer(0, 1)
    writer.write(batch([1, 2]))
    handle = json.loads(json.dumps(writer.pre_commit(7)))  # stored in the checkpoint as JSON
    del writer  # crash before the checkpoint-complete notification
    assert values(backend.output(format)) == []
    sink.create_writer(0, 1, restored_transactions=[handle])
    assert values(backend.output(format)) == [1, 2]
    sink.create_writer(0, 1, restored_transactions=[handle])  # a second failure during restore
    assert values(backend.output(format)) == [1, 2]
    assert backend.pending() == []


@FORMATS
def test_recommit_after_commit_is_a_noop(backend: Backend, format: str) -> None:
    sink = backend.sink(format)
    writer = sink.create_writer(0, 1)
    writer.write(batch([5]))
    handle = writer.pre_commit(3)
    writer.commit(3, [handle])
    writer.commit(3, [handle])
    del writer  # crash after commit: the restored checkpoint still names the handle
    sink.create_writer(0, 1, restored_transactions=[handle])
    assert values(backend.output(format)) == [5]
    assert [n for n in backend.names() if n.startswith("part-")] == [handle["file"]]


@FORMATS
def test_crash_between_copy_and_delete_is_finished_by_the_next_commit(backend: Backend, format: str) -> None:
    sink = backend.sink(format)
    writer = sink.create_writer(0, 1)
    writer.write(batch([1]))
    handle = writer.pre_commit(4)
    backend.fs.copy(f"{backend.root}/_pending/{handle['file']}", f"{backend.root}/{handle['file']}")
    sink.create_writer(0, 1, restored_transactions=[handle])
    assert values(backend.output(format)) == [1]
    assert backend.pending() == []


@FORMATS
def test_pending_files_not_named_by_restored_handles_are_discarded(backend: Backend, format: str) -> None:
    sink = backend.sink(format)
    writer = sink.create_writer(0, 1)
    writer.write(batch([1]))
    h1 = writer.pre_commit(1)  # checkpoint 1 completes in the coordinator ...
    writer.write(batch([2]))
    writer.pre_commit(2)  # ... checkpoint 2 never does
    del writer
    sink.create_writer(0, 1, restored_transactions=[h1])
    assert values(backend.output(format)) == [1]
    assert backend.pending() == []


def test_storage_options_a_local_path_would_ignore_are_refused(tmp_path) -> None:
    """fsspec's local file system takes any keyword: credentials or an endpoint meant for an
    object store (a URL given without its s3://), or a misspelt key, passed unnoticed."""
    for make in (lambda o: FileSink(str(tmp_path / "out"), storage_options=o),
                 lambda o: FileSource(f"file://{tmp_path}/*.txt", storage_options=o)):
        with pytest.raises(ConfigError, match=r"unknown storage option\(s\) 'anon', 'endpoint_url' for a local path; "
                                              r"a local path takes only auto_mkdir, .*s3://bucket/prefix"):
            make({"endpoint_url": "http://127.0.0.1:9000", "anon": True})
        make({"auto_mkdir": True})  # what fsspec's local file system acts on: fine
        make({})


def test_a_transaction_restored_into_another_directory_names_both(tmp_path) -> None:
    """A savepoint restored with the FileSink pointed at a new directory: the pending file of
    the restored checkpoint is in the old one. The error once said "something else deleted sink
    files"; it names both directories and the file, and publishes nothing."""
    import re

    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old = FileSink(str(old_dir), format="jsonl")
    writer = old.create_writer(0, 1)
    writer.write(batch([1]))
    handle = writer.pre_commit(3)
    assert handle["dir"] == str(old_dir)
    new = FileSink(str(new_dir), format="jsonl")
    with pytest.raises(FileSinkError, match=rf"checkpoint 3 \(subtask 0\) was written under {re.escape(str(old_dir))}, "
                                            rf"and this job's FileSink writes to {re.escape(str(new_dir))}: its 1 rows "
                                            rf"are in {re.escape(str(old_dir))}/_pending/{handle['file']}"):
        new.create_writer(0, 1, restored_transactions=[handle])
    legacy = {k: v for k, v in handle.items() if k != "dir"}  # a handle of an older release: as before
    with pytest.raises(FileSinkError, match="is lost"):
        new.create_writer(0, 1, restored_transactions=[legacy])
    assert read_output(str(new_dir), "jsonl").num_rows == 0
    old.create_writer(0, 1, restored_transactions=[handle])  # with the directory as it was: published
    assert values(read_output(str(old_dir), "jsonl")) == [1]


@FORMATS
def test_several_epochs_are_committed_by_one_notification(backend: Backend, format: str) -> None:
    writer = backend.sink(format).create_writer(0, 1)
    handles = []
    for checkpoint, vals in [(1, [1]), (2, []), (3, [2, 3])]:
        writer.write(batch(vals))
        handles.append(writer.pre_commit(checkpoint))
    assert handles[1] is None
    writer.commit(3, handles)
    assert read_output(backend.url, format, backend.options).column("v").to_pylist() == [1, 2, 3]


@FORMATS
@pytest.mark.parametrize(("old_p", "new_p"), [(3, 2), (1, 3), (4, 1)])
def test_rescale_with_union_restored_handles_commits_each_once_and_removes_orphans(
    backend: Backend, format: str, old_p: int, new_p: int
) -> None:
    sink = backend.sink(format)
    old = [sink.create_writer(s, old_p) for s in range(old_p)]
    handles = []
    for s, w in enumerate(old):
        w.write(batch([10 + s]))
        handles.append(w.pre_commit(5))  # checkpoint 5: restored later
        w.write(batch([100 + s]))
        w.pre_commit(6)  # checkpoint 6 never completes: orphans, including subtasks >= new_p
    del old, w
    union = json.loads(json.dumps(handles))
    assert len(backend.pending()) == 2 * old_p

    # new writers come up one by one; each commits exactly the handles it owns
    for s in reversed(range(new_p)):
        sink.create_writer(s, new_p, restored_transactions=union)
        owned = sorted(10 + h["subtask"] for h in handles if h["subtask"] % new_p >= s)
        assert values(backend.output(format)) == owned
    assert values(backend.output(format)) == [10 + s for s in range(old_p)]
    assert backend.pending() == []
    # a second restore of the same checkpoint changes nothing
    for s in range(new_p):
        sink.create_writer(s, new_p, restored_transactions=union)
    assert values(backend.output(format)) == [10 + s for s in range(old_p)]


@FORMATS
def test_commit_only_publishes_handles_the_writer_owns(backend: Backend, format: str) -> None:
    sink = backend.sink(format)
    w0, w1 = sink.create_writer(0, 2), sink.create_writer(1, 2)
    w1.write(batch([1]))
    h1 = w1.pre_commit(1)
    w0.commit(1, [h1])
    assert values(backend.output(format)) == []
    w1.commit(1, [h1])
    assert values(backend.output(format)) == [1]


def test_fresh_writer_leaves_other_subtasks_pending_files_alone(backend: Backend) -> None:
    sink = backend.sink("parquet")
    w1 = sink.create_writer(1, 2)
    w1.write(batch([1]))
    h1 = w1.pre_commit(1)
    sink.create_writer(0, 2)  # subtask 0 starting late must not delete subtask 1's epoch
    w1.commit(1, [h1])
    assert values(backend.output("parquet")) == [1]


def test_lost_transaction_error_names_the_files(backend: Backend) -> None:
    sink = backend.sink("jsonl")
    writer = sink.create_writer(0, 1)
    writer.write(batch([1]))
    handle = writer.pre_commit(9)
    backend.fs.rm(f"{backend.root}/_pending/{handle['file']}")
    with pytest.raises(FileSinkError, match=rf"checkpoint 9.*is lost.*{handle['file']}"):
        sink.create_writer(0, 1, restored_transactions=[handle])


def test_store_publish_is_idempotent_and_tolerates_a_concurrent_publisher(any_backend: Backend) -> None:
    backend = any_backend
    store = Files(backend.fs)
    src, dst = f"{backend.root}/_pending/x.bin", f"{backend.root}/x.bin"
    store.put(src, b"payload")
    assert store.publish(src, dst)
    assert store.publish(src, dst)  # repeated (e.g. a second writer with the same handle)
    assert not store.exists(src)
    assert backend.fs.cat_file(dst) == b"payload"
    assert not store.publish(f"{backend.root}/_pending/none", f"{backend.root}/none")


@pytest.mark.parametrize(
    ("handle", "message"),
    [
        ({"v": 99, "file": "part-00000001-000-" + "0" * 32 + ".parquet"}, "version 99 needs a newer version"),
        ("garbage", "not a FileSink transaction handle"),
        ({"v": 1, "file": f"part-00000001-000-{'0' * 32}.jsonl", "checkpoint": 1, "subtask": 0, "rows": 1}, "format"),
        ({"v": 1, "file": "x"}, "malformed transaction handle"),
    ],
)
def test_bad_handles_are_rejected_with_a_clear_message(mem_root: str, handle: Any, message: str) -> None:
    with pytest.raises(FileSinkError, match=message):
        FileSink(mem_root, format="parquet").create_writer(0, 1, restored_transactions=[handle])


def test_parquet_epoch_with_conflicting_schemas_names_the_sink(mem_root: str) -> None:
    writer = FileSink(mem_root).create_writer(0, 1)
    writer.write(pa.record_batch({"v": [1]}))
    writer.write(pa.record_batch({"v": ["x"]}))
    with pytest.raises(FileSinkError, match="different schemas.*cast them"):
        writer.pre_commit(1)


def test_jsonl_writes_one_object_per_row_with_str_fallback(mem_root: str) -> None:
    import datetime

    writer = FileSink(mem_root, format="jsonl").create_writer(2, 3)
    writer.write(pa.record_batch({"d": [datetime.date(2024, 1, 2)], "t": ["é"]}))
    handle = writer.pre_commit(1)
    writer.commit(1, [handle])
    text = MEM.cat_file(f"{mem_path(mem_root)}/{handle['file']}").decode()
    assert text == '{"d": "2024-01-02", "t": "é"}\n'
    assert handle["file"].startswith("part-00000001-002-")


def test_pyarrow_dataset_reads_only_committed_parquet(tmp_path: Any) -> None:
    import pyarrow.dataset as ds

    sink = FileSink(str(tmp_path / "out"))
    writer = sink.create_writer(0, 1)
    writer.write(batch([1]))
    writer.commit(1, [writer.pre_commit(1)])
    writer.write(batch([2]))
    writer.pre_commit(2)  # pending, invisible
    assert ds.dataset(str(tmp_path / "out"), format="parquet").to_table().column("v").to_pylist() == [1]
    # a FileSource over the output directory skips _pending/ too
    committed = sorted(p.name for p in (tmp_path / "out").glob("part-*"))
    assert len(committed) == 1
    assert FileSource(f"{tmp_path}/out/**", format="parquet").splits() == committed


def test_sink_is_picklable_and_validates_options(mem_root: str) -> None:
    sink = pickle.loads(pickle.dumps(FileSink(mem_root, format="jsonl")))
    assert sink.format == "jsonl"
    with pytest.raises(ConfigError, match="format"):
        FileSink(mem_root, format="csv")
    with pytest.raises(ConfigError, match="subtask 2"):
        FileSink(mem_root).create_writer(2, 2)


@pytest.mark.parametrize("path", ["", "  ", 5, None])
def test_a_sink_or_source_without_a_path_is_refused(path: Any) -> None:
    """"" once named the working directory (a job wrote its part files there) and a non-str
    raised a bare TypeError ("argument of type 'int' is not iterable")."""
    with pytest.raises(ConfigError, match=r"FileSink: the path must be a non-empty str"):
        FileSink(path)
    with pytest.raises(ConfigError, match=r"FileSource: the path must be a non-empty str"):
        FileSource(path)


def test_a_sink_directory_under_a_file_is_refused_before_the_job_runs(tmp_path) -> None:
    """A FileSink path under a regular file failed the job only at its first commit, at the end
    of its input here (OperatorError with a NotADirectoryError traceback), its work lost."""
    import abs

    (tmp_path / "taken").write_text("not a directory")
    for path in (tmp_path / "taken", tmp_path / "taken" / "out"):
        with pytest.raises(ConfigError, match=r"which is a file, not a directory|is a file, not a directory"):
            FileSink(str(path))
    flow = abs.Dataflow("sink-under-a-file")
    flow.source("src", abs.GeneratorSource(100)).sink("out", abs.FileSink(str(tmp_path / "out")))
    (tmp_path / "out").write_text("a file took the directory's place since")
    # where the job starts (no record read yet): a start-up error naming the sink and the cause
    with pytest.raises(abs.StartupError, match=r"creating its tasks: ConfigError: FileSink .*out': is a file") as err:
        abs.run(flow)
    assert err.value.permanent


def test_read_output_of_missing_directory_is_empty(mem_root: str) -> None:
    assert read_output(f"{mem_root}/none", "parquet").num_rows == 0


# --------------------------------------------------------------------------- S3 (moto server on loopback)


@pytest.mark.s3
def test_s3_sink_two_phase_commit_crashes_and_rescale(s3_backend: Backend) -> None:
    backend, sink = s3_backend, s3_backend.sink("parquet")
    old = [sink.create_writer(s, 3) for s in range(3)]
    handles = []
    for s, w in enumerate(old):
        w.write(batch([10 + s]))
        handles.append(w.pre_commit(1))
    old[0].commit(1, [handles[0]])  # subtask 0 saw the completion, then everything crashed
    backend.fs.copy(f"{backend.root}/_pending/{handles[1]['file']}", f"{backend.root}/{handles[1]['file']}")
    for w in old:
        w.write(batch([99]))
        w.pre_commit(2)  # never completes
    assert values(backend.output("parquet")) == [10, 11]  # 11: crashed between copy and delete
    union = json.loads(json.dumps(handles))
    for s in range(2):
        sink.create_writer(s, 2, restored_transactions=union)
    assert values(backend.output("parquet")) == [10, 11, 12]
    assert backend.pending() == []


@pytest.mark.s3
def test_s3_text_source_resumes_at_offsets(s3_backend: Backend) -> None:
    backend = s3_backend
    backend.fs.pipe_file(f"{backend.root}/in/a.txt", "x\r\né\n\nlast".encode())
    source = FileSource(f"{backend.url}/in/*.txt", storage_options=backend.options, batch_size=2)
    reader = source.create_reader({s: 0 for s in source.splits()}, 0, 1)
    first, _ = poll_batches(reader, 1)
    rest = read_everything(source, reader.offsets())
    assert [r["line"] for r in rows(first + rest)] == ["x", "é", "", "last"]


def test_rollback_removes_committed_and_pending_files_above_the_checkpoint(any_backend: Backend) -> None:
    """FileSink.rollback (a restore that falls back): what checkpoints above the one restored
    published goes, pending files above it too; the file names are the record; repeatable."""
    sink = any_backend.sink("parquet")
    writers = [sink.create_writer(s, 2) for s in range(2)]
    for cid in (1, 2, 3):
        for w in writers:
            w.write(batch([cid * 10 + w.subtask]))
            txn = w.pre_commit(cid)
            if cid < 3:
                w.commit(cid, [txn])  # checkpoint 3 stays pending
    writers[0].write(batch([99]))
    writers[0].pre_commit(4)
    assert sink.committed_checkpoints() == [1, 2]
    done = sink.rollback(1)
    assert done.checkpoints == (2,) and done.items == 2
    assert values(any_backend.output("parquet")) == [10, 11]
    assert [n for n in any_backend.pending() if not n.startswith("part-00000001")] == []
    assert sink.rollback(1).items == 0 and values(any_backend.output("parquet")) == [10, 11]
