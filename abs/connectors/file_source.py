"""File source: :class:`FileSource` reads the files an fsspec glob matches (local paths,
``file://``, ``memory://``, ``s3://``), replayably.

Source offsets
    A split is one file matched by the source's glob when the job starts. Its offset is a
    plain JSON integer: for ``format="text"`` the **byte offset** of the next line to read,
    for ``format="parquet"`` the **global row index** (counted over all row groups) of the
    next row to read. A reader restarted from an offset seeks straight to it: text files are
    not re-read from the start, parquet files skip the row groups before the offset.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import pyarrow as pa

from ..errors import AbsError, ConfigError
from .fs import absolute, check_local_options, open_fs
from .sources import END, Source, SourceReader

if TYPE_CHECKING:
    from .sources import _End

__all__ = ["FileSource", "FileSourceError", "NoFilesMatchedWarning"]

_SOURCE_FORMATS = ("text", "parquet")
_TEXT_COLUMNS = ("line", "file")
_GLOB_CHARS = re.compile(r"[*?\[]")
_BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 20


# --------------------------------------------------------------------------- errors


class FileSourceError(AbsError, OSError):
    """A source file cannot be read as the checkpoint expects: it vanished, is unreadable,
    is not valid UTF-8 (text), or changed since the offsets were stored (an offset past its
    end or not at a line start).

    Remedy: the message names the file. Restore the file as it was, or restart the job
    without restoring this source's offsets (the file is then read from the start).
    """


class NoFilesMatchedWarning(UserWarning):
    """A :class:`FileSource` glob matched no file: the source has zero splits and ends at once."""


# --------------------------------------------------------------------------- paths


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
        self.path_glob = absolute(path_glob, "FileSource")
        self.format = format
        self.storage_options = dict(storage_options or {})
        check_local_options(self.path_glob, self.storage_options, what="FileSource")
        self.batch_size = batch_size
        self.columns = columns

    def __repr__(self) -> str:
        return f"FileSource({self.path_glob!r}, format={self.format!r})"

    def _open_fs(self) -> tuple[Any, _Glob]:
        fs, path = open_fs(self.path_glob, self.storage_options, what="FileSource")
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
