"""File connectors: :class:`FileSource` (replayable reads) and :class:`FileSink` (exactly-once
output by two-phase commit), over any fsspec file system (local paths, ``file://``,
``memory://``, ``s3://``).

Source offsets
    A split is one file matched by the source's glob when the job starts. Its offset is a
    plain JSON integer: for ``format="text"`` the **byte offset** of the next line to read,
    for ``format="parquet"`` the **global row index** (counted over all row groups) of the
    next row to read. A reader restarted from an offset seeks straight to it: text files are
    not re-read from the start, parquet files skip the row groups before the offset.

Sink transactions
    A writer buffers the epoch's batches in memory; ``pre_commit(n)`` writes them in one
    piece to ``<path>/_pending/part-<n:08d>-<subtask:03d>-<uuid>.<ext>`` (a single PUT on
    object stores) and returns the handle ``{"v": 1, "file": <name>, "checkpoint": n,
    "subtask": <subtask>, "rows": <rows>}``; ``commit`` moves the file to
    ``<path>/<name>`` (an atomic rename on local disks; copy-then-delete on other file
    systems, so a crash in between leaves the final file visible and the pending copy is
    deleted by the next commit). Readers of ``<path>`` (Spark, ``pyarrow.dataset``,
    :func:`read_output`) ignore ``_pending/`` because its name starts with ``_``.

Commit ownership (the rule that makes rescaling safe)
    A handle records the subtask that wrote it. Among the writers of a job with parallelism
    ``P``, the handle is committed only by the writer ``handle["subtask"] % P``, and pending
    files are cleaned up under the same rule (pending file of old subtask ``s`` -> writer
    ``s % P``). So the runtime may hand the restored handles of *every* old subtask to
    *every* new writer (the "union" redistribution rule, which the runtime must use for
    sink transactions): each handle is committed by exactly one writer, and pending files
    of old subtasks ``>= P`` are cleaned up too. Each commit step also tolerates having
    been done already (by a crashed attempt or a concurrent writer): the final name is
    fixed by the handle, so a file can be neither lost nor duplicated.

Rollback (a restore that falls back to an older checkpoint)
    A part file's name starts with the id of the checkpoint whose epoch it holds: the file
    became visible when that checkpoint (or a later one) completed, and the restored
    checkpoint ``c`` covers exactly the files with ids ``<= c`` (older epochs are committed, or
    re-committed from ``c``'s handles). :meth:`FileSink.rollback` therefore deletes the part
    files (committed and pending) with ids ``> c``, highest id first, so that a rollback
    stopped part-way leaves every file up to some id intact and a second one finishes it. The
    file names are the record: it works without any manifest, on directories written before
    rollback existed too. One job per output directory (files of another job with higher ids
    would be deleted as well).
"""
from __future__ import annotations

import io
import json
import os
import re
import uuid
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import pyarrow as pa

from .errors import AbsError, ConfigError
from .sinks import Sink, SinkRollback, SinkWriter
from .sources import END, Source, SourceReader

if TYPE_CHECKING:
    from .sources import _End

__all__ = [
    "FileSource",
    "FileSink",
    "FileSinkWriter",
    "FileSourceError",
    "FileSinkError",
    "NoFilesMatchedWarning",
    "read_output",
]

_SOURCE_FORMATS = ("text", "parquet")
_SINK_FORMATS = {"parquet": "parquet", "jsonl": "jsonl"}  # format -> file extension
_TEXT_COLUMNS = ("line", "file")
_GLOB_CHARS = re.compile(r"[*?\[]")
_BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 20
HANDLE_VERSION = 1


# --------------------------------------------------------------------------- errors


class FileSourceError(AbsError, OSError):
    """A source file cannot be read as the checkpoint expects: it vanished, is unreadable,
    is not valid UTF-8 (text), or changed since the offsets were stored (an offset past its
    end or not at a line start).

    Remedy: the message names the file. Restore the file as it was, or restart the job
    without restoring this source's offsets (the file is then read from the start).
    """


class FileSinkError(AbsError, OSError):
    """A sink transaction cannot be committed (its pending and final files are both gone),
    a transaction handle is malformed or from a newer version, or an epoch's batches
    cannot be written to one file.

    Remedy: the message names the file or handle and what to do.
    """


class NoFilesMatchedWarning(UserWarning):
    """A :class:`FileSource` glob matched no file: the source has zero splits and ends at once."""


# --------------------------------------------------------------------------- paths


def _absolute(url: str) -> str:
    """Make a local relative path absolute, so that workers with another working
    directory resolve it the same way (URLs with a protocol are left alone)."""
    if "://" in url or url.startswith("/"):
        return url
    return os.path.abspath(url)


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **dict(storage_options or {}))
    return fs, path.rstrip("/") or path


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol


@dataclass(frozen=True)
class _Glob:
    """A source glob split into its literal base directory and the pattern below it.

    Split ids are the matched paths relative to ``base``; ``path(split)`` inverts that.
    A pattern without wildcards names one file: its base is the file's directory.
    """

    base: str
    pattern: str
    literal: bool

    @classmethod
    def parse(cls, path: str) -> "_Glob":
        parts = path.split("/")
        first_magic = next((i for i, p in enumerate(parts) if _GLOB_CHARS.search(p)), None)
        if first_magic is None:
            return cls(base="/".join(parts[:-1]), pattern=path, literal=True)
        return cls(base="/".join(parts[:first_magic]), pattern=path, literal=False)

    def split_id(self, path: str) -> str:
        prefix = self.base + "/"
        if not path.startswith(prefix):
            raise FileSourceError(f"FileSource: matched path {path!r} is not below the glob base {self.base!r}")
        return path[len(prefix):]

    def path(self, split: str) -> str:
        return f"{self.base}/{split}"

    @staticmethod
    def hidden(split: str) -> bool:
        """Spark/Hadoop convention: a component starting with ``_`` or ``.`` is not data."""
        return any(part.startswith(("_", ".")) for part in split.split("/"))


@dataclass(frozen=True)
class _SinkLayout:
    """The only place sink paths and part-file names are formatted or parsed."""

    root: str
    ext: str

    _NAME = re.compile(r"^part-(\d{8,})-(\d{3,})-([0-9a-f]{32})\.([a-z]+)$")

    @property
    def pending_dir(self) -> str:
        return f"{self.root}/_pending"

    def new_name(self, checkpoint_id: int, subtask: int) -> str:
        return f"part-{checkpoint_id:08d}-{subtask:03d}-{uuid.uuid4().hex}.{self.ext}"

    def pending(self, name: str) -> str:
        return f"{self.pending_dir}/{name}"

    def final(self, name: str) -> str:
        return f"{self.root}/{name}"

    def parse(self, name: str) -> tuple[int, int] | None:
        """``(checkpoint_id, subtask)`` of a part-file name of this sink's format, else None."""
        m = self._NAME.match(name)
        if m is None or m.group(4) != self.ext:
            return None
        return int(m.group(1)), int(m.group(2))


# --------------------------------------------------------------------------- source


class FileSource(Source):
    """Reads the files matched by an fsspec glob; one split per file.

    ``path_glob`` is a local path or URL with wildcards (``*``, ``?``, ``[...]``, ``**``
    for any depth), e.g. ``"s3://bucket/logs/2024-*/*.txt"``. Splits are enumerated once,
    when the job starts: the split id is the file's path relative to the glob's *base* (the
    directory part before the first wildcard), and splits are sorted. Directories are not
    splits, and neither are paths with a component below the base starting with ``_`` or
    ``.`` (``_SUCCESS``, ``_pending/``, ``.crc``: the convention Spark follows). A path
    without wildcards names exactly one file. A glob that matches nothing gives zero
    splits and a :class:`NoFilesMatchedWarning`.

    ``format="text"``: one record per line, as UTF-8 string columns ``line`` (without its
    ``\\n`` or ``\\r\\n`` terminator; a last line without terminator is a line too; a UTF-8
    byte-order mark at the start of a file is dropped) and ``file`` (the split id).
    ``columns`` may select a subset of these two. The offset is the byte offset of the next
    line.

    ``format="parquet"``: the file's own columns (``columns`` selects some), in batches of
    up to ``batch_size`` rows. Files with different schemas give batches with different
    schemas. The offset is the index of the next row in the file.

    A reader reads its splits one after the other, in split-id order; a batch never spans
    two files.
    """

    def __init__(
        self,
        path_glob: str,
        *,
        format: str = "text",
        storage_options: Mapping[str, Any] | None = None,
        batch_size: int = 4096,
        columns: Sequence[str] | None = None,
    ) -> None:
        if format not in _SOURCE_FORMATS:
            raise ConfigError(f"FileSource {path_glob!r}: format must be one of {_SOURCE_FORMATS}, got {format!r}")
        if batch_size < 1:
            raise ConfigError(f"FileSource {path_glob!r}: batch_size must be >= 1, got {batch_size}")
        if columns is not None:
            columns = list(columns)
            if not columns:
                raise ConfigError(f"FileSource {path_glob!r}: columns must be None (all) or a non-empty list")
            if format == "text" and not set(columns) <= set(_TEXT_COLUMNS):
                raise ConfigError(
                    f"FileSource {path_glob!r}: text columns are {list(_TEXT_COLUMNS)}, got {columns}"
                )
        self.path_glob = _absolute(path_glob)
        self.format = format
        self.storage_options = dict(storage_options or {})
        self.batch_size = batch_size
        self.columns = columns

    def __repr__(self) -> str:
        return f"FileSource({self.path_glob!r}, format={self.format!r})"

    def _open_fs(self) -> tuple[Any, _Glob]:
        fs, path = _filesystem(self.path_glob, self.storage_options)
        return fs, _Glob.parse(path)

    def splits(self) -> list[str]:
        fs, glob = self._open_fs()
        try:
            matches = fs.glob(glob.pattern, detail=True)
        except FileNotFoundError:
            matches = {}
        except OSError as exc:
            raise FileSourceError(
                f"FileSource: cannot list {self.path_glob!r}: {exc}; check the path and storage_options"
            ) from exc
        if glob.literal and any(info.get("type") == "directory" for info in matches.values()):
            raise ConfigError(
                f"FileSource: {self.path_glob!r} is a directory; "
                f"use a glob such as {self.path_glob.rstrip('/') + '/*'!r} or '.../**' to read its files"
            )
        found = (glob.split_id(str(p)) for p, info in matches.items() if info.get("type", "file") == "file")
        splits = sorted(s for s in found if glob.literal or not glob.hidden(s))
        if not splits:
            warnings.warn(
                f"FileSource: {self.path_glob!r} matched no file; the source has zero splits "
                "and ends at once (check the path, the wildcards and storage_options)",
                NoFilesMatchedWarning,
                stacklevel=2,
            )
        return splits

    def initial_offset(self, split: str) -> int:
        return 0

    def create_reader(self, splits: Mapping[str, Any], subtask: int, parallelism: int) -> SourceReader:
        fs, glob = self._open_fs()
        offsets = {}
        for split, offset in splits.items():
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise FileSourceError(
                    f"FileSource {self.path_glob!r}: split {split!r} has offset {offset!r}; "
                    "expected a non-negative integer (was the checkpoint written by another source?)"
                )
            offsets[str(split)] = offset
        return _FileReader(self, fs, glob, offsets)


class _TextCursor:
    """Reads lines of one text file from a byte offset; ``position`` is the next line's offset."""

    def __init__(self, fs: Any, path: str, split: str, start: int, columns: Sequence[str], batch_size: int) -> None:
        self.path = path
        self.split = split
        self.position = start
        self._columns = columns
        self._batch_size = batch_size
        self._file = fs.open(path, "rb")
        self._chunks: list[bytes] = []  # bytes read from ``position`` on, not yet emitted
        self._newlines = 0  # number of b"\n" in ``_chunks``
        self._eof = False
        if start > 0:
            try:
                self._check_start(start)
            except BaseException:
                self._file.close()
                raise

    def _check_start(self, start: int) -> None:
        self._file.seek(start - 1)
        before = self._file.read(1)
        if not before:
            raise FileSourceError(
                f"FileSource: file {self.path} is shorter than the restored offset {start}; "
                "it changed since the checkpoint. Restore the file or restart without restored offsets"
            )
        if before != b"\n" and self._file.read(1):
            raise FileSourceError(
                f"FileSource: restored offset {start} of file {self.path} is not at a line start; "
                "the file changed since the checkpoint. Restore the file or restart without restored offsets"
            )
        self._file.seek(start)

    def _take(self, n: int) -> list[bytes]:
        """Up to ``n`` lines (terminators removed, except a ``\\r``) and advance ``position``."""
        while not self._eof and self._newlines < n:
            chunk = self._file.read(_READ_CHUNK)
            if not chunk:
                self._eof = True
                break
            self._chunks.append(chunk)
            self._newlines += chunk.count(b"\n")
        buf = b"".join(self._chunks)
        parts = buf.split(b"\n", n)
        if len(parts) > n:  # n complete lines; the rest stays buffered
            lines, rest = parts[:n], parts[n]
            self._newlines -= n
        else:  # end of file: every remaining line, the last one maybe without terminator
            lines, rest = parts, b""
            self._newlines = 0
            if lines[-1] == b"":
                lines.pop()
        self._chunks = [rest] if rest else []
        self.position += len(buf) - len(rest)
        return lines

    def next_batch(self) -> pa.RecordBatch | None:
        """The next up to ``batch_size`` lines, or None at the end of the file."""
        start = self.position
        lines = self._take(self._batch_size)
        if not lines:
            return None
        if start == 0 and lines[0].startswith(_BOM):
            lines[0] = lines[0][len(_BOM):]
        cleaned = [line[:-1] if line.endswith(b"\r") else line for line in lines]
        try:
            text = pa.array(cleaned, type=pa.binary()).cast(pa.string())
        except pa.ArrowInvalid as exc:
            raise FileSourceError(
                f"FileSource: file {self.path} is not valid UTF-8 between bytes {start} and {self.position}; "
                "convert it to UTF-8 (text files are read as UTF-8 only)"
            ) from exc
        arrays = [
            text if name == "line" else pa.repeat(pa.scalar(self.split, pa.string()), len(lines))
            for name in self._columns
        ]
        return pa.RecordBatch.from_arrays(arrays, names=list(self._columns))

    def close(self) -> None:
        self._file.close()


class _ParquetCursor:
    """Reads one parquet file from a global row index; ``position`` is the next row's index."""

    def __init__(
        self, fs: Any, path: str, split: str, start: int, columns: Sequence[str] | None, batch_size: int
    ) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self.split = split
        self.position = start
        self._file = fs.open(path, "rb")
        try:
            parquet = pq.ParquetFile(self._file)
        except (pa.ArrowException, OSError) as exc:
            self._file.close()
            raise FileSourceError(
                f"FileSource: file {path} is not a readable parquet file ({exc}); "
                "remove it from the input or fix it"
            ) from exc
        meta = parquet.metadata
        if start > meta.num_rows:
            self._file.close()
            raise FileSourceError(
                f"FileSource: restored offset {start} of file {path} is past its {meta.num_rows} rows; "
                "the file changed since the checkpoint. Restore the file or restart without restored offsets"
            )
        if columns is not None:
            missing = [c for c in columns if c not in parquet.schema_arrow.names]
            if missing:
                self._file.close()
                raise FileSourceError(
                    f"FileSource: file {path} has no column(s) {missing}; its columns are "
                    f"{parquet.schema_arrow.names}. Fix the columns option"
                )
        first_group, skip = 0, start
        while first_group < meta.num_row_groups and skip >= meta.row_group(first_group).num_rows:
            skip -= meta.row_group(first_group).num_rows
            first_group += 1
        self._skip = skip
        self._batches: Iterator[pa.RecordBatch] = parquet.iter_batches(
            batch_size=batch_size,
            row_groups=list(range(first_group, meta.num_row_groups)),
            columns=None if columns is None else list(columns),
        )

    def next_batch(self) -> pa.RecordBatch | None:
        """The next up to ``batch_size`` rows, or None at the end of the file."""
        for batch in self._batches:
            if self._skip:
                dropped = min(self._skip, batch.num_rows)
                batch, self._skip = batch.slice(dropped), self._skip - dropped
            if batch.num_rows:
                self.position += batch.num_rows
                return batch
        return None

    def close(self) -> None:
        self._file.close()


class _FileReader(SourceReader):
    """Reads its splits one after the other, in split-id order."""

    def __init__(self, source: FileSource, fs: Any, glob: _Glob, offsets: dict[str, int]) -> None:
        self._source = source
        self._fs = fs
        self._glob = glob
        self._offsets = dict(offsets)
        self._todo = sorted(self._offsets)
        self._cursor: _TextCursor | _ParquetCursor | None = None

    def offsets(self) -> dict[str, int]:
        return dict(self._offsets)

    def wait_hint(self) -> float:
        return 0.0

    def poll(self) -> "pa.RecordBatch | _End":
        while self._todo:
            split = self._todo[0]
            if self._cursor is None:
                self._cursor = self._open(split, self._offsets[split])
            try:
                batch = self._cursor.next_batch()
            except FileSourceError:
                raise
            except (OSError, pa.ArrowException) as exc:
                raise FileSourceError(
                    f"FileSource: reading file {self._cursor.path} (split {split!r}) at offset "
                    f"{self._cursor.position} failed ({exc}); check that it still exists and is readable"
                ) from exc
            self._offsets[split] = self._cursor.position
            if batch is not None:
                return batch
            self._cursor.close()
            self._cursor = None
            self._todo.pop(0)
        return END

    def _open(self, split: str, start: int) -> _TextCursor | _ParquetCursor:
        src = self._source
        path = self._glob.path(split)
        try:
            if src.format == "text":
                return _TextCursor(self._fs, path, split, start, src.columns or _TEXT_COLUMNS, src.batch_size)
            return _ParquetCursor(self._fs, path, split, start, src.columns, src.batch_size)
        except FileSourceError:
            raise
        except FileNotFoundError as exc:
            raise FileSourceError(
                f"FileSource: file {path} (split {split!r}) is gone; it was listed when the job started "
                "(or is named in the restored checkpoint's offsets). Restore it, or start the job "
                "without restoring this source's offsets"
            ) from exc
        except OSError as exc:
            raise FileSourceError(
                f"FileSource: file {path} (split {split!r}) cannot be opened ({exc}); "
                "check its permissions, the storage_options and that it is a regular file"
            ) from exc

    def close(self) -> None:
        if self._cursor is not None:
            self._cursor.close()
            self._cursor = None


# --------------------------------------------------------------------------- store contract


class _Store:
    """The few file operations the sink's commit protocol relies on.

    - ``put`` writes a whole file so that it is never observed half-written under a name a
      handle refers to (the handle is returned only after ``put`` returned);
    - ``publish(src, dst)`` makes ``dst`` hold ``src``'s bytes and removes ``src``. It is
      idempotent and safe to repeat after a crash at any point, or to run concurrently
      for the same pair: a rename on local disks (atomic), copy-then-delete elsewhere
      (``dst`` appears atomically with its full content, and a repeated copy rewrites the
      same bytes). It reports whether ``dst`` exists afterwards.
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.local = _is_local(fs)

    def put(self, path: str, data: bytes) -> None:
        if self.local:
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(path, data)

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else bool(self.fs.exists(path))

    def refresh(self, path: str) -> None:
        """Forget cached listings under ``path`` (s3fs caches them; others changed files)."""
        if not self.local:
            self.fs.invalidate_cache(path)

    def list_names(self, directory: str) -> list[str]:
        try:
            if self.local:
                return sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
            infos = self.fs.ls(directory, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(str(i["name"]).rstrip("/").rsplit("/", 1)[-1] for i in infos if i.get("type") == "file")

    def delete(self, path: str) -> None:
        try:
            if self.local:
                os.remove(path)
            else:
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def publish(self, src: str, dst: str) -> bool:
        self.refresh(src)
        self.refresh(dst)
        if self.local:
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                pass  # published before (or by a concurrent writer)
            else:
                _fsync_dir(os.path.dirname(dst))
        elif self.exists(src):
            try:
                self.fs.copy(src, dst)
            except FileNotFoundError:
                pass  # a concurrent writer published and deleted it meanwhile
            self.delete(src)
        return self.exists(dst)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- sink


@dataclass(frozen=True)
class _Transaction:
    """A parsed transaction handle (see the module docstring for its JSON form)."""

    file: str
    checkpoint: int
    subtask: int
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {
            "v": HANDLE_VERSION,
            "file": self.file,
            "checkpoint": self.checkpoint,
            "subtask": self.subtask,
            "rows": self.rows,
        }

    @classmethod
    def from_json(cls, handle: Any, layout: _SinkLayout) -> "_Transaction":
        if not isinstance(handle, Mapping) or not isinstance(handle.get("v"), int):
            raise FileSinkError(
                f"FileSink {layout.root}: {handle!r} is not a FileSink transaction handle; "
                "restore this sink from a checkpoint written by a FileSink"
            )
        if handle["v"] > HANDLE_VERSION:
            raise FileSinkError(
                f"FileSink {layout.root}: transaction handle version {handle['v']} needs a newer version "
                f"of this toolkit (this one reads version {HANDLE_VERSION}); upgrade to restore"
            )
        try:
            txn = cls(str(handle["file"]), int(handle["checkpoint"]), int(handle["subtask"]), int(handle["rows"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FileSinkError(f"FileSink {layout.root}: malformed transaction handle {handle!r} ({exc})") from exc
        if layout.parse(txn.file) is None:
            raise FileSinkError(
                f"FileSink {layout.root}: transaction handle names {txn.file!r}, not a {layout.ext} part file "
                "of this sink; was the sink's format changed? Restore with the same format"
            )
        return txn


class FileSink(Sink):
    """Exactly-once file output: one part file per subtask and checkpoint that had data.

    ``path`` is an output directory (local path or fsspec URL). Committed files are
    ``<path>/part-<checkpoint:08d>-<subtask:03d>-<uuid>.<ext>``; uncommitted ones live in
    ``<path>/_pending/``, which Spark and ``pyarrow.dataset`` ignore. ``format="parquet"``
    writes one parquet file per epoch (the epoch's batches must share a schema, up to
    null-typed columns); ``format="jsonl"`` writes one JSON object per row
    (``json.dumps(row, default=str)``: dates, timestamps, decimals and bytes become strings).

    The epoch's output is buffered in the writer's memory until the checkpoint barrier.
    One job per output directory: a writer deletes the pending files of its subtasks that
    no restored handle names. See the module docstring for the commit rule under rescaling.

    A restore of checkpoint ``c`` first rolls the directory back to ``c`` (``supports_rollback``):
    part files committed by checkpoints above ``c`` are deleted, and the job writes them again.
    """

    supports_rollback = True

    def __init__(
        self, path: str, *, format: str = "parquet", storage_options: Mapping[str, Any] | None = None
    ) -> None:
        if format not in _SINK_FORMATS:
            raise ConfigError(f"FileSink {path!r}: format must be one of {list(_SINK_FORMATS)}, got {format!r}")
        self.path = _absolute(path)
        self.format = format
        self.storage_options = dict(storage_options or {})

    def __repr__(self) -> str:
        return f"FileSink({self.path!r}, format={self.format!r})"

    def _layout(self) -> tuple[_Store, _SinkLayout]:
        fs, root = _filesystem(self.path, self.storage_options)
        return _Store(fs), _SinkLayout(root=root, ext=_SINK_FORMATS[self.format])

    def _part_files(self) -> tuple[_Store, _SinkLayout, list[tuple[int, str]], list[tuple[int, str]]]:
        """``(store, layout, committed, pending)``; each a list of ``(checkpoint id, path)``."""
        store, layout = self._layout()
        found: list[list[tuple[int, str]]] = []
        for directory, path_of in ((layout.root, layout.final), (layout.pending_dir, layout.pending)):
            store.refresh(directory)
            names = ((layout.parse(n), n) for n in store.list_names(directory))
            found.append([(parsed[0], path_of(n)) for parsed, n in names if parsed is not None])
        return store, layout, found[0], found[1]

    def committed_checkpoints(self) -> list[int]:
        """Ids of the checkpoints whose part files are committed in the directory (from the names)."""
        return sorted({cid for cid, _ in self._part_files()[2]})

    def rollback(self, to_checkpoint: int) -> SinkRollback:
        """Delete the part files (committed and pending) of checkpoints above ``to_checkpoint``,
        highest id first; returns the committed ones deleted. Idempotent."""
        store, layout, committed, pending = self._part_files()
        doomed = sorted(((cid, path) for cid, path in committed + pending if cid > to_checkpoint), reverse=True)
        for _, path in doomed:
            store.delete(path)
        if doomed and store.local:
            _fsync_dir(layout.root)
            _fsync_dir(layout.pending_dir)
        removed = [cid for cid, path in committed if cid > to_checkpoint]
        return SinkRollback(checkpoints=tuple(sorted(set(removed))), items=len(removed), unit="files")

    def create_writer(
        self, subtask: int, parallelism: int, restored_transactions: Sequence[Any] = ()
    ) -> "FileSinkWriter":
        if parallelism < 1 or not 0 <= subtask < parallelism:
            raise ConfigError(f"FileSink {self.path!r}: subtask {subtask} is not in [0, parallelism={parallelism})")
        store, layout = self._layout()
        return FileSinkWriter(self.format, store, layout, subtask, parallelism, restored_transactions)


class FileSinkWriter(SinkWriter):
    """One subtask's writer; built by :meth:`FileSink.create_writer`.

    At creation it commits the restored handles it owns and deletes the pending files it
    owns that no restored handle names (epochs after the restored checkpoint).
    """

    def __init__(
        self,
        format: str,
        store: _Store,
        layout: _SinkLayout,
        subtask: int,
        parallelism: int,
        restored_transactions: Sequence[Any],
    ) -> None:
        self._format = format
        self._store = store
        self._layout = layout
        self.subtask = subtask
        self.parallelism = parallelism
        self._batches: list[pa.RecordBatch] = []
        restored = [_Transaction.from_json(h, layout) for h in restored_transactions if h is not None]
        self._commit_owned(restored)
        self._discard_orphans({t.file for t in restored})

    def owns(self, old_subtask: int) -> bool:
        """Whether this writer commits and cleans up what subtask ``old_subtask`` wrote."""
        return old_subtask % self.parallelism == self.subtask

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        self._batches.extend(b for b in batches if b.num_rows)

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any] | None:
        """Write the buffered epoch to a pending file; ``None`` (and no file) if it is empty."""
        if not self._batches:
            return None
        rows = sum(b.num_rows for b in self._batches)
        data = self._encode(self._batches)
        name = self._layout.new_name(checkpoint_id, self.subtask)
        self._store.put(self._layout.pending(name), data)
        self._batches = []
        return _Transaction(name, checkpoint_id, self.subtask, rows).to_json()

    def commit(self, checkpoint_id: int, transactions: Sequence[Any]) -> None:
        """Publish the handles this writer owns (idempotent; others are skipped)."""
        self._commit_owned([_Transaction.from_json(h, self._layout) for h in transactions if h is not None])

    def close(self) -> None:
        self._batches = []

    def _commit_owned(self, transactions: Sequence[_Transaction]) -> None:
        owned = [t for t in transactions if self.owns(t.subtask)]
        for txn in owned:
            pending, final = self._layout.pending(txn.file), self._layout.final(txn.file)
            if not self._store.publish(pending, final):
                raise FileSinkError(
                    f"FileSink: transaction of checkpoint {txn.checkpoint} (subtask {txn.subtask}) is lost: "
                    f"neither {pending} nor {final} exists. Something else deleted sink files; "
                    f"its {txn.rows} rows are missing from the output. Restore an older checkpoint or "
                    "re-run the job into a fresh directory"
                )

    def _discard_orphans(self, keep: set[str]) -> None:
        self._store.refresh(self._layout.pending_dir)
        for name in self._store.list_names(self._layout.pending_dir):
            parsed = self._layout.parse(name)
            if parsed is not None and self.owns(parsed[1]) and name not in keep:
                self._store.delete(self._layout.pending(name))

    def _encode(self, batches: list[pa.RecordBatch]) -> bytes:
        if self._format == "jsonl":
            lines = (json.dumps(row, default=str, ensure_ascii=False) for b in batches for row in b.to_pylist())
            return "".join(line + "\n" for line in lines).encode("utf-8")
        import pyarrow.parquet as pq

        try:
            table = pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="default")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            schemas = sorted({str(b.schema) for b in batches})
            raise FileSinkError(
                f"FileSink {self._layout.root}: subtask {self.subtask} received batches with different schemas "
                f"in one epoch ({exc}); cast them to one schema before the sink. Schemas: {schemas}"
            ) from exc
        out = io.BytesIO()
        pq.write_table(table, out)
        return out.getvalue()


def read_output(path: str, format: str = "parquet", storage_options: Mapping[str, Any] | None = None) -> pa.Table:
    """Every committed part file of a :class:`FileSink` output directory, in name order
    (checkpoint, then subtask), as one table; pending files are not read.

    For tests and small outputs. JSON lines are parsed with :mod:`json` and typed by
    ``pa.Table.from_pylist``. An empty or missing directory gives an empty table.
    """
    sink = FileSink(path, format=format, storage_options=storage_options)
    store, layout = sink._layout()
    store.refresh(layout.root)
    names = [n for n in store.list_names(layout.root) if layout.parse(n) is not None]
    tables = [_read_part(store.fs, layout.final(n), format) for n in names]
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")


def _read_part(fs: Any, path: str, format: str) -> pa.Table:
    with fs.open(path, "rb") as f:
        data = f.read()
    if format == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(data))
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
    return pa.Table.from_pylist(rows)
