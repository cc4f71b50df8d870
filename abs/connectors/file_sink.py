"""File sink: :class:`FileSink` writes exactly-once output by two-phase commit over any
fsspec file system (local paths, ``file://``, ``memory://``, ``s3://``); :func:`read_output`
reads what it committed.

Sink transactions
    A writer buffers the epoch's batches in memory; ``pre_commit(n)`` writes them in one
    piece to ``<path>/_pending/part-<n:08d>-<subtask:03d>-<uuid>.<ext>`` (atomically: see
    :mod:`abs.connectors.fs`; a single PUT on object stores) and returns the handle ``{"v": 1, "file": <name>, "checkpoint": n,
    "subtask": <subtask>, "rows": <rows>, "dir": <path>}`` (``dir``: the sink's directory as its
    file system names it, so that a restore into another directory can say where the pending
    file is; handles without it still read); ``commit`` moves the file to
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
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pyarrow as pa

from ..errors import AbsError, ConfigError
from .fs import Files, absolute, check_local_options, fsync_dir, open_fs, temp_target
from .sinks import Sink, SinkRollback, SinkWriter

__all__ = ["FileSink", "FileSinkWriter", "FileSinkError", "read_output"]

_SINK_FORMATS = {"parquet": "parquet", "jsonl": "jsonl"}  # format -> file extension
HANDLE_VERSION = 1


# --------------------------------------------------------------------------- errors



class FileSinkError(AbsError, OSError):
    """A sink transaction cannot be committed (its pending and final files are both gone),
    a transaction handle is malformed or from a newer version, or an epoch's batches
    cannot be written to one file.

    Remedy: the message names the file or handle and what to do.
    """



# --------------------------------------------------------------------------- paths


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



# --------------------------------------------------------------------------- sink


@dataclass(frozen=True)
class _Transaction:
    """A parsed transaction handle (see the module docstring for its JSON form)."""

    file: str
    checkpoint: int
    subtask: int
    rows: int
    directory: str | None = None  # the sink's directory when it wrote the file (None: a handle from before)

    def to_json(self) -> dict[str, Any]:
        handle = {
            "v": HANDLE_VERSION,
            "file": self.file,
            "checkpoint": self.checkpoint,
            "subtask": self.subtask,
            "rows": self.rows,
        }
        if self.directory is not None:
            handle["dir"] = self.directory
        return handle

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
            directory = handle.get("dir")
            txn = cls(str(handle["file"]), int(handle["checkpoint"]), int(handle["subtask"]), int(handle["rows"]),
                      None if directory is None else str(directory))
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
        self.path = absolute(path, "FileSink", directory=True)
        if format not in _SINK_FORMATS:
            raise ConfigError(f"FileSink {path!r}: format must be one of {list(_SINK_FORMATS)}, got {format!r}")
        self.format = format
        self.storage_options = dict(storage_options or {})
        check_local_options(self.path, self.storage_options, what="FileSink")

    def __repr__(self) -> str:
        return f"FileSink({self.path!r}, format={self.format!r})"

    def _layout(self) -> tuple[Files, _SinkLayout]:
        fs, root = open_fs(self.path, self.storage_options, what="FileSink")
        return Files(fs), _SinkLayout(root=root, ext=_SINK_FORMATS[self.format])

    def _part_files(self) -> tuple[Files, _SinkLayout, list[tuple[int, str]], list[tuple[int, str]]]:
        """``(store, layout, committed, pending)``; each a list of ``(checkpoint id, path)``."""
        store, layout = self._layout()
        found: list[list[tuple[int, str]]] = []
        for directory, path_of in ((layout.root, layout.final), (layout.pending_dir, layout.pending)):
            store.refresh(directory)
            names = ((layout.parse(n), n) for n in store.list_files(directory))
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
            fsync_dir(layout.root)
            fsync_dir(layout.pending_dir)
        removed = [cid for cid, path in committed if cid > to_checkpoint]
        return SinkRollback(checkpoints=tuple(sorted(set(removed))), items=len(removed), unit="files")

    def create_writer(
        self, subtask: int, parallelism: int, restored_transactions: Sequence[Any] = ()
    ) -> "FileSinkWriter":
        if parallelism < 1 or not 0 <= subtask < parallelism:
            raise ConfigError(f"FileSink {self.path!r}: subtask {subtask} is not in [0, parallelism={parallelism})")
        absolute(self.path, "FileSink", directory=True)  # again where it runs: a file may have taken its place
        store, layout = self._layout()
        return FileSinkWriter(self.format, store, layout, subtask, parallelism, restored_transactions)


class FileSinkWriter(SinkWriter):
    """One subtask's writer; built by :meth:`FileSink.create_writer`.

    At creation it commits the restored handles it owns and deletes the pending files it
    owns that no restored handle names (epochs after the restored checkpoint), and the
    temporary files a crash left behind while writing a pending file it owns.
    """

    def __init__(
        self,
        format: str,
        store: Files,
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
        return _Transaction(name, checkpoint_id, self.subtask, rows, self._layout.root).to_json()

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
                if txn.directory is not None and txn.directory != self._layout.root:
                    raise FileSinkError(
                        f"FileSink: transaction of checkpoint {txn.checkpoint} (subtask {txn.subtask}) was written "
                        f"under {txn.directory}, and this job's FileSink writes to {self._layout.root}: its "
                        f"{txn.rows} rows are in {txn.directory}/_pending/{txn.file}, not here. Restore with the "
                        "FileSink's directory as it was (the output continues there), or copy that pending file "
                        f"into {self._layout.pending_dir}/ first; nothing was published"
                    )
                raise FileSinkError(
                    f"FileSink: transaction of checkpoint {txn.checkpoint} (subtask {txn.subtask}) is lost: "
                    f"neither {pending} nor {final} exists. Something else deleted sink files; "
                    f"its {txn.rows} rows are missing from the output. Restore an older checkpoint or "
                    "re-run the job into a fresh directory"
                )

    def _discard_orphans(self, keep: set[str]) -> None:
        self._store.refresh(self._layout.pending_dir)
        for name in self._store.list_files(self._layout.pending_dir):
            target = temp_target(name)  # the rest of a pending file whose write a crash cut short
            parsed = self._layout.parse(name if target is None else target)
            if parsed is not None and self.owns(parsed[1]) and (target is not None or name not in keep):
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
    names = [n for n in store.list_files(layout.root) if layout.parse(n) is not None]
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

        # one file in memory, read without the dataset scanner and its background threads:
        # those have been seen to abort the interpreter at exit ("terminate called without an
        # active exception", a known pyarrow issue) after a job's output was read
        return pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
    return pa.Table.from_pylist(rows)
