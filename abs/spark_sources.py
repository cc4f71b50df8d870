"""Spark streaming sources as barrier-injecting, exactly-once replayable ABS sources.

Two wrappers share one design: a **driver-side producer** writes a durable, immutable **log
of numbered batches**; **barrier-injecting readers** in the workers consume the log by batch
id; a reader's offset is *(batch id, unit inside the batch, row inside the unit)*. A crash
anywhere therefore replays exactly: the restored offsets name batches that are still in the
log, and a batch never changes once it is visible.

:class:`SparkStreamSource`
    Wraps a PySpark Python data source (``pyspark.sql.datasource.DataSource`` with a
    ``streamReader`` or ``simpleStreamReader``) or a ``DataSourceStreamReader`` instance. In
    the driver, a planner thread calls ``initialOffset()`` / ``latestOffset(start, limit)``
    and ``partitions(start, end)``, as Spark's micro-batch engine does, and appends batch
    ``b`` = *(start, end, pickled InputPartitions)* to the log (``batch-<b>.json``) before any
    reader can see it. Ranges that plan no partition are not logged. Readers call the data
    source's ``read(partition)`` in the workers (no Spark there) and turn tuples, ``Row``\\ s or
    ``pyarrow.RecordBatch``\\ es into Arrow batches of the data source's schema (converted
    from the ``StructType`` in the driver; a DDL string is parsed with the active Spark
    session when the source is built). ``partitions(start, end)`` and ``read(partition)``
    must be deterministic (Spark relies on that too). A data source with only
    ``simpleStreamReader`` is wrapped exactly as Spark wraps it (pyspark's
    ``_SimpleStreamReaderWrapper``): ``read(start)`` runs in the driver to find the end offset
    (its rows are cached there until ``commit``), and the workers re-read the range with
    ``readBetweenOffsets(start, end)``, one partition per batch. A data source with neither
    is refused when the source is built.

:class:`SparkMicroBatchSource`
    Wraps any Structured Streaming DataFrame (files, Kafka, rate, Delta...). ``driver_open``
    starts ``df.writeStream.foreachBatch(stage)`` with Spark's own ``checkpointLocation``.
    ``stage`` writes micro-batch ``b`` as Parquet parts into ``batch-<b>/`` and then its
    ``_manifest.json`` (create-if-absent: the first complete staging of a batch id wins, a
    replayed batch id keeps the content already staged) *before returning*, so before Spark
    commits the batch. Readers replay staged batches by id. Each micro-batch is collected
    to the driver (``DataFrame.toArrow``): size micro-batches with the source's own limits
    (``maxFilesPerTrigger``, ``maxOffsetsPerTrigger``...).

Log / staging layout (any fsspec URL the workers can reach; default
``<storage>/sources/<uid>/``)::

    batch-000000000007.json        SparkStreamSource: one immutable file per planned batch
    batch-000000000007/            SparkMicroBatchSource: part-*.parquet, then _manifest.json
    _end.json                      bounded mode: {"batches": n}; readers end after batch n-1
    _error.json                    the producer failed (readers raise; the job restarts)
    _committed.json / _consumed.json   what was committed upstream / deleted
    _spark_checkpoint/             SparkMicroBatchSource: Spark's checkpointLocation (default)

Every file is made visible atomically: temp file + link/rename on local disks, a single PUT
(create-if-absent for batch files) on object stores. ``memory://`` is refused: fsspec's
memory file system is private to one process and the workers are other processes.

Lanes and offsets
    Split ids are lanes ``"0" .. str(num_splits - 1)`` (fixed for a job's life: changing
    ``num_splits`` needs a fresh start). Unit ``j`` (an InputPartition, or a Parquet part) of
    batch ``b`` belongs to lane ``(b + j) % num_splits``, so one-unit batches still spread
    over all lanes. A lane's offset is ``{"batch": b, "partition": j, "row": r}``
    (``"part"`` instead of ``"partition"`` for the micro-batch source): the next row to read
    is row ``r`` of unit ``j`` of batch ``b``; every batch below ``b`` is fully consumed by
    that lane. A reader restored at ``r > 0`` re-reads the unit and skips ``r`` rows.
    Bounded logs end with ``_end.json``; a lane at ``batch == n`` has returned END.

Commit rule (SparkStreamSource)
    When checkpoint ``n`` completes (``driver_checkpoint_complete``, in order, after its
    manifest is durable), ``B = min(lane["batch"])`` over all lanes it stores: batches
    ``< B`` are fully consumed by every lane *and covered by a completed checkpoint*. The
    reader's ``commit(end)`` is called with the end offset of batch ``B - 1`` if that batch
    is newer than the last one committed; never twice for the same batch, always in order,
    never for anything a completed checkpoint does not cover. (Spark itself commits one
    batch late and does not commit the last batch under ``availableNow``: do not rely on
    ``commit`` for correctness either way.) The last committed batch is recorded in
    ``_committed.json`` after the call: a driver process that dies in between commits that
    end once more when the job is restored.

Deletion rule
    Log batches below ``min(B)`` over the last ``retained`` completed checkpoints
    (``SourceContext.retained``, the checkpoints storage retention keeps and a restart may
    restore) are deleted; the newest logged batch of a SparkStreamSource is always kept (the
    planner continues after it). The driver passes the offsets of every complete checkpoint
    and savepoint of the storage root (``SourceContext.stored_offsets`` / ``pinned_offsets``),
    so this also holds after a restore in a new driver process, and batches a savepoint in the
    root needs are kept. A savepoint written to another root (``JobHandle.savepoint(path)``)
    is not seen: it restores only as long as the log still holds its batches.

Restarts
    ``driver_open`` runs before every attempt. A fresh start (first attempt, nothing restored)
    empties the log/staging (and Spark's default checkpoint location): the stream starts over
    from ``initialOffset()`` / the query's start. After a restart the log is kept: logged
    batches are replayed, not re-planned, and the planner continues after the last logged
    batch; the micro-batch query resumes from Spark's checkpoint (a batch id replayed by Spark
    after its staged copy was consumed and deleted is not staged again).

Bounded mode
    ``SparkStreamSource(..., bounded=True)`` is Spark's ``availableNow``: a reader that
    implements ``SupportsTriggerAvailableNow`` gets ``prepareForTriggerAvailableNow()`` and is
    planned with its default read limit until ``latestOffset`` returns its start; any other
    reader is planned as one batch up to ``latestOffset(start, ReadAllAvailable())`` (what
    Spark's wrapper does). ``SparkMicroBatchSource(..., trigger={"availableNow": True})`` (or
    ``{"once": True}``) ends when the query terminates by itself. The producer then writes
    ``_end.json`` durably and readers return END after the last batch.

Costs and limits
    A lane waiting for the next batch looks for it (and for the end/error markers) with a
    backoff up to 0.2 s: a few small reads per second per waiting reader, also on S3. The
    planner does not throttle on the readers: an unbounded source that always has data keeps
    appending batches (one small file each, every ``trigger_interval``) however far the
    readers are behind; deletion follows completed checkpoints only.

Example::

    import abs
    from abs.spark_sources import SparkStreamSource, SparkMicroBatchSource

    flow = abs.Dataflow("events")
    src = SparkStreamSource(MyDataSource, {"topic": "t"}, num_splits=4)
    flow.source("src", src).map(lambda r: r).sink("out", abs.CollectSink())
    abs.run(flow, parallelism=2, checkpoint=abs.CheckpointConfig(interval=1.0), storage="./snap")

    df = spark.readStream.schema("id long, v string").json("/data/in")
    src = SparkMicroBatchSource(df, num_splits=4, trigger={"availableNow": True})
"""
from __future__ import annotations

import base64
import inspect
import io
import json
import os
import re
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from typing import Any, Iterator, Mapping

import pyarrow as pa

from .errors import AbsError, ConfigError
from .sources import END, Source, SourceContext, SourceReader

__all__ = ["SparkStreamSource", "SparkMicroBatchSource", "SparkSourceError"]

_BATCH_FILE = re.compile(r"^batch-(\d{12})\.json$")
_BATCH_DIR = re.compile(r"^batch-(\d{12})$")
_PART_FILE = re.compile(r"^part-\d{5}-[0-9a-f]{32}\.parquet$")
_MARKERS = ("_end.json", "_error.json", "_committed.json", "_consumed.json")


class SparkSourceError(AbsError, RuntimeError):
    """A Spark source cannot go on: its driver-side producer failed (the data source's
    planner raised, the Spark query failed), a batch the restored offsets need is missing
    from the log, or ``read()`` returned data that does not fit the schema.

    Remedy: the message names the log and the cause. Producer failures make the job restart
    (with a restart strategy); fix the data source or query if they repeat.
    """


# --------------------------------------------------------------------------- log files


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


class _Log:
    """A directory of log files on any fsspec file system (picklable: the file system is
    opened lazily in each process)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None) -> None:
        self.url = url
        self.options = dict(options or {})
        self._fs: Any = None
        self._root: str | None = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "options": self.options, "_fs": None, "_root": None}

    def _open(self) -> tuple[Any, str]:
        if self._fs is None:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(self.url, **self.options)
            self._fs, self._root = fs, (path.rstrip("/") or path)
        assert self._root is not None
        return self._fs, self._root

    @property
    def fs(self) -> Any:
        return self._open()[0]

    @property
    def root(self) -> str:
        return self._open()[1]

    @property
    def local(self) -> bool:
        return _is_local(self.fs)

    def path(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def read(self, path: str) -> bytes | None:
        """The file's bytes, ``None`` if it does not exist (no listing cache involved)."""
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def read_json(self, path: str) -> Any:
        data = self.read(path)
        return None if data is None else json.loads(data.decode("utf-8"))

    def _mkdir(self, path: str) -> None:
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)

    def _local_temp(self, path: str, data: bytes) -> str:
        self._mkdir(path)
        tmp = os.path.join(os.path.dirname(path), f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, path: str, data: bytes) -> None:
        """Write ``path`` atomically (readers see the old file or the new one, whole)."""
        if self.local:
            os.replace(self._local_temp(path, data), path)
        else:
            self.fs.pipe_file(path, data)

    def create(self, path: str, data: bytes) -> bool:
        """Write ``path`` atomically if it does not exist; ``False`` if it already did."""
        if self.local:
            tmp = self._local_temp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError, ValueError):  # no create-if-absent on this file system
            if self.read(path) is not None:
                return False
            self.fs.pipe_file(path, data)
            return True

    def delete(self, path: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass

    def names(self) -> list[str]:
        """Names directly below the root (``[]`` if it does not exist)."""
        fs = self.fs
        try:
            fs.invalidate_cache(self.root)
        except Exception:  # noqa: BLE001 - not every file system caches
            pass
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def wipe(self, extra: tuple[str, ...] = ()) -> None:
        """Delete what this module wrote below the root (batch files and directories, markers,
        temp files) and the names in ``extra``; anything else is left alone."""
        for name in self.names():
            if (_BATCH_FILE.match(name) or _BATCH_DIR.match(name) or name in _MARKERS
                    or name.startswith(".tmp-") or name in extra):
                self.delete(self.path(name), recursive=True)


def _resolve_log_url(
    what: str, given: str | None, options: Mapping[str, Any] | None, context: SourceContext, param: str
) -> _Log:
    if given is not None:
        url, opts = given, options
    elif context.storage_url is not None:
        url = f"{context.storage_url.rstrip('/')}/sources/{urllib.parse.quote(context.uid, safe='')}"
        opts = options if options is not None else context.storage_options
        if url.startswith("memory:"):
            raise ConfigError(
                f"{what}: its {param} defaults to {url!r}, below the job's storage on fsspec's memory file system, "
                f"which is private to the driver process; the worker processes cannot read it. Pass {param}= a "
                "local directory, file:// or s3:// URL (or use such a storage=)"
            )
    else:
        raise ConfigError(
            f"{what} {context.uid!r}: no place for its log: run the job with storage=... or pass {param}=<URL> "
            "(a directory every worker can reach)"
        )
    _check_reachable(what, url, param)
    return _Log(_absolute(url), opts)


def _absolute(url: str) -> str:
    if "://" in url or url.startswith("/"):
        return url
    return os.path.abspath(url)


def _check_reachable(what: str, url: str, param: str) -> None:
    if url.startswith("memory:"):
        raise ConfigError(
            f"{what}: {param}={url!r} is on fsspec's memory file system, which is private to one process; "
            f"the worker processes cannot read it. Pass {param}= a local directory, file:// or s3:// URL"
        )


# --------------------------------------------------------------------------- retention


class _Retention:
    """Driver-side bookkeeping of completed checkpoints, for the deletion rule."""

    def __init__(self) -> None:
        self.entries: list[int] = []  # consumed-batch bound B of each known completed checkpoint
        self.unknown_older = False
        self.retained = 1
        self.floor: int | None = None  # lowest bound of a savepoint in the storage root

    def opened(self, context: SourceContext, restored_bound: int | None, fresh: bool, lanes: list[str]) -> None:
        self.retained = max(1, int(context.retained))
        pins = [b for b in (_bound(o, lanes) for o in context.pinned_offsets) if b is not None]
        self.floor = min(pins) if pins and not fresh else None
        if fresh:
            self.entries, self.unknown_older = [], False
        elif context.stored_offsets is not None:
            # the driver read every complete checkpoint of the root: retention is exact, also
            # in a new driver process
            bounds = [b for b in (_bound(o, lanes) for o in context.stored_offsets) if b is not None]
            self.entries = bounds[-self.retained:] or ([restored_bound] if restored_bound is not None else [])
            self.unknown_older = False
        elif restored_bound is not None and not self.entries:
            # restored in a new driver: older retained checkpoints are unknown to us
            self.entries, self.unknown_older = [restored_bound], True

    def completed(self, bound: int) -> int | None:
        """Record a completed checkpoint; returns the batch id below which nothing is needed."""
        self.entries.append(bound)
        self.entries = self.entries[-self.retained:]
        if self.unknown_older and len(self.entries) < self.retained:
            return None
        self.unknown_older = False
        return min(self.entries) if self.floor is None else min(min(self.entries), self.floor)


def _lane_offset(value: Any, lane: str, num_splits: int, key: str, what: str) -> tuple[int, int, int]:
    try:
        b, j, r = int(value["batch"]), int(value[key]), int(value["row"])
    except (TypeError, KeyError, ValueError):
        raise SparkSourceError(
            f"{what}: lane {lane!r} has offset {value!r}; expected {{'batch': b, {key!r}: j, 'row': r}} "
            "(was the checkpoint written by another source?)"
        ) from None
    if b < 0 or j < 0 or r < 0 or (b + j) % num_splits != int(lane) % num_splits:
        raise SparkSourceError(
            f"{what}: lane {lane!r} has offset {value!r}, which does not belong to lane {lane} of "
            f"{num_splits}; was num_splits changed? Restore with the num_splits the checkpoint was taken with"
        )
    return b, j, r


def _bound(offsets: Mapping[str, Any], lanes: list[str]) -> int | None:
    """``min(batch)`` over every lane: batches below it are fully consumed by all lanes."""
    if not lanes or set(offsets) != set(lanes):
        return None
    try:
        return min(int(offsets[lane]["batch"]) for lane in lanes)
    except (TypeError, KeyError, ValueError):
        return None


def _check_restored_lanes(what: str, restored: Mapping[str, Any] | None, lanes: list[str]) -> None:
    if restored and set(restored) != set(lanes):
        raise ConfigError(
            f"{what}: the restored checkpoint has lanes {sorted(restored, key=str)}, this source has "
            f"{lanes} (num_splits={len(lanes)}); restore with the num_splits the checkpoint was taken with"
        )


# --------------------------------------------------------------------------- lane reader


class _LaneReader(SourceReader):
    """Reads the lanes assigned to one source subtask from a batch log."""

    unit_key = "partition"

    def __init__(self, log: _Log, splits: Mapping[str, Any], num_splits: int, what: str) -> None:
        self._log = log
        self._n = num_splits
        self._what = what
        self._cursors: dict[str, list[int]] = {}
        for lane, value in splits.items():
            self._cursors[str(lane)] = list(_lane_offset(value, str(lane), num_splits, self.unit_key, what))
        self._order = sorted(self._cursors, key=int)
        self._iters: dict[str, Iterator[pa.RecordBatch] | None] = {lane: None for lane in self._order}
        self._ended: set[str] = set()
        self._cache: dict[int, Any] = {}
        self._end: int | None = None
        self._gap_checked: set[int] = set()
        self._missing: set[int] = set()
        self._turn = 0
        self._wait = 0.01

    # -- to implement
    def _fetch(self, batch: int) -> Any:
        """The batch's units (a list), or ``None`` if the batch is not (yet) in the log."""
        raise NotImplementedError

    def _open_unit(self, batch: int, units: Any, unit: int, skip: int) -> Iterator[pa.RecordBatch]:
        raise NotImplementedError

    def _exists(self, batch: int) -> bool:
        raise NotImplementedError

    # -- SourceReader
    def offsets(self) -> dict[str, dict]:
        return {lane: {"batch": b, self.unit_key: j, "row": r} for lane, (b, j, r) in self._cursors.items()}

    def wait_hint(self) -> float:
        return self._wait

    def poll(self) -> "pa.RecordBatch | None | Any":
        if len(self._ended) == len(self._order):
            return END
        self._missing: set[int] = set()  # batches not in the log at this poll (looked up once per poll)
        n = len(self._order)
        for k in range(n):
            lane = self._order[(self._turn + k) % n]
            if lane in self._ended:
                continue
            got = self._poll_lane(lane)
            if got is END:
                self._ended.add(lane)
                continue
            if got is not None:
                self._turn = (self._turn + k + 1) % n
                self._wait = 0.01
                return got
        if len(self._ended) == len(self._order):
            return END
        self._wait = min(0.2, self._wait * 2)
        return None

    def close(self) -> None:
        self._iters = {lane: None for lane in self._order}
        self._cache.clear()

    # -- internals
    def _batch(self, b: int) -> Any:
        if b in self._cache:
            return self._cache[b]
        if self._end is not None and b >= self._end:
            return END
        if b in self._missing:
            return None
        units = self._fetch(b)
        if units is not None:
            for old in [k for k in self._cache if k < min(c[0] for c in self._cursors.values())]:
                del self._cache[old]
            self._cache[b] = units
            return units
        end = self._log.read_json(self._log.path("_end.json"))
        if end is not None:
            self._end = int(end["batches"])
            if b >= self._end:
                return END
        error = self._log.read_json(self._log.path("_error.json"))
        if error is not None:
            raise SparkSourceError(f"{self._what}: the driver-side producer failed: {error.get('error')}")
        if b not in self._gap_checked:
            self._gap_checked.add(b)
            if self._exists(b + 1) or (self._end is not None and b < self._end):
                raise SparkSourceError(
                    f"{self._what}: batch {b} is missing from {self._log.url} although later batches exist; "
                    "something deleted it (or a checkpoint older than the log's retention was restored). "
                    "Restore a newer checkpoint or start the job fresh"
                )
        self._missing.add(b)
        return None

    def _poll_lane(self, lane: str) -> Any:
        cur = self._cursors[lane]
        for _ in range(10_000):  # bounded work per poll (skipping empty batches)
            it = self._iters[lane]
            if it is None:
                units = self._batch(cur[0])
                if units is END or units is None:
                    return units
                if cur[1] >= len(units):
                    cur[0] += 1
                    cur[1] = (int(lane) - cur[0]) % self._n
                    cur[2] = 0
                    continue
                it = self._open_unit(cur[0], units, cur[1], cur[2])
                self._iters[lane] = it
            chunk = next(it, None)
            if chunk is None:
                self._iters[lane] = None
                cur[1] += self._n
                cur[2] = 0
                continue
            if chunk.num_rows == 0:
                continue
            cur[2] += chunk.num_rows
            return chunk
        return None


# --------------------------------------------------------------------------- schemas and rows


def _active_session() -> Any:
    """A live SparkContext's session (``True`` if only the context is known), else ``None``.

    ``SparkSession.getActiveSession()`` is thread-local on the JVM side, and the driver hooks
    may run in another thread than the one that built the session: look at the process-wide
    SparkContext instead."""
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError:  # pragma: no cover - pyspark is a dependency of this module
        return None
    sc = SparkContext._active_spark_context
    if sc is None or getattr(sc, "_jsc", None) is None:
        return None
    return SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None) or True


def _resolve_schema(schema: Any, what: str) -> tuple[Any, pa.Schema]:
    """(StructType, Arrow schema) from a StructType, a DDL string or a pyarrow schema."""
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
    from pyspark.sql.types import StructType

    if isinstance(schema, pa.Schema):
        return from_arrow_schema(schema), schema
    if isinstance(schema, str):
        if _active_session() is None:
            raise ConfigError(
                f"{what}: the schema is the DDL string {schema!r}; parsing DDL needs an active SparkSession. "
                "Create the source while a SparkSession is active, or give the schema as a "
                "pyspark.sql.types.StructType or a pyarrow.Schema (schema=...)"
            )
        try:
            schema = StructType.fromDDL(schema)
        except Exception as exc:  # noqa: BLE001 - Spark's parse errors come in many classes
            raise ConfigError(f"{what}: cannot parse the schema {schema!r}: {exc}") from exc
    if not isinstance(schema, StructType):
        raise ConfigError(
            f"{what}: schema must be a StructType, a DDL string or a pyarrow.Schema, got {type(schema).__name__}"
        )
    try:
        return schema, to_arrow_schema(schema, timezone="UTC")
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{what}: schema {schema.simpleString()} has no Arrow equivalent: {exc}") from exc


def _rows_to_batch(rows: list, schema: pa.Schema, what: str) -> pa.RecordBatch:
    names = schema.names
    columns: list[list] = [[] for _ in names]
    for row in rows:
        fields = getattr(row, "__fields__", None)
        if fields is not None and isinstance(row, tuple):  # a pyspark Row with names
            d = row.asDict()
            try:
                values = [d[n] for n in names]
            except KeyError as exc:
                raise SparkSourceError(f"{what}: read() returned {row!r}, which has no field {exc}") from None
        elif isinstance(row, (tuple, list)):
            values = row
        else:
            raise SparkSourceError(
                f"{what}: read() must yield tuples, Rows or pyarrow.RecordBatch, got {type(row).__name__}: {row!r}"
            )
        if len(values) != len(names):
            raise SparkSourceError(f"{what}: read() returned {row!r} for the schema {names} ({len(names)} fields)")
        for col, v in zip(columns, values):
            col.append(v)
    arrays = []
    for col, field in zip(columns, schema):
        try:
            arrays.append(pa.array(col, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
            raise SparkSourceError(
                f"{what}: column {field.name!r} does not fit its declared type {field.type}: {exc}"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _conform(batch: pa.RecordBatch, schema: pa.Schema, what: str) -> pa.RecordBatch:
    if batch.schema.equals(schema):
        return batch
    try:
        cols = [batch.column(f.name).cast(f.type) for f in schema]
        return pa.RecordBatch.from_arrays(cols, schema=schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise SparkSourceError(
            f"{what}: read() returned a RecordBatch with schema {batch.schema}, expected {schema}: {exc}"
        ) from None


def _arrow_chunks(items: Any, schema: pa.Schema, batch_size: int, skip: int, what: str) -> Iterator[pa.RecordBatch]:
    """Arrow batches of at most ``batch_size`` rows from what ``read()`` yields, after
    skipping the first ``skip`` rows."""
    buf: list = []
    for item in items:
        if isinstance(item, pa.RecordBatch):
            if buf:
                yield _rows_to_batch(buf, schema, what)
                buf = []
            batch = _conform(item, schema, what)
            if skip:
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                batch = batch.slice(skip)
                skip = 0
            for off in range(0, batch.num_rows, batch_size):
                yield batch.slice(off, batch_size)
            continue
        if skip:
            skip -= 1
            continue
        buf.append(item)
        if len(buf) >= batch_size:
            yield _rows_to_batch(buf, schema, what)
            buf = []
    if buf:
        yield _rows_to_batch(buf, schema, what)


# --------------------------------------------------------------------------- SparkStreamSource


def _overrides(obj: Any, name: str, base: type) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def _make_stream_reader(data_source: Any, struct: Any) -> Any:
    from pyspark.sql.datasource import DataSource

    if _overrides(data_source, "streamReader", DataSource):
        return data_source.streamReader(struct)
    from pyspark.sql.datasource_internal import _SimpleStreamReaderWrapper

    return _SimpleStreamReaderWrapper(data_source.simpleStreamReader(struct))


def _latest(reader: Any, start: Any, limit: Any) -> Any:
    try:
        params = inspect.signature(reader.latestOffset).parameters
    except (TypeError, ValueError):
        params = {"start": None, "limit": None}
    if len(params) == 0:  # the pre-4.2 signature latestOffset()
        return reader.latestOffset()
    return reader.latestOffset(start, limit)


def _supports_available_now(reader: Any) -> Any:
    """The object whose ``prepareForTriggerAvailableNow`` to call, or None."""
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

    if isinstance(reader, SupportsTriggerAvailableNow):
        return reader
    inner = getattr(reader, "simple_reader", None)
    if inner is not None and isinstance(inner, SupportsTriggerAvailableNow):
        return inner
    return None


class SparkStreamSource(Source):
    """A PySpark Python data source stream reader as an exactly-once ABS source.

    ``data_source``: a ``pyspark.sql.datasource.DataSource`` subclass (instantiated with
    ``options``) or instance, implementing ``streamReader(schema)`` or
    ``simpleStreamReader(schema)`` (wrapped like Spark does); or a
    ``DataSourceStreamReader`` instance (then ``schema=`` is required; it is pickled when the
    source is built and unpickled in each worker for ``read()``; the driver plans with the
    instance itself). ``schema``: overrides ``DataSource.schema()``; a StructType, a DDL
    string (parsed now, with the active Spark session) or a pyarrow schema.

    ``num_splits``: number of lanes (split ids ``"0"..``), fixed for the job's life.
    ``bounded``: stop like Spark's ``availableNow`` (see the module docstring).
    ``log``/``log_options``: where the batch log lives (default ``<storage>/sources/<uid>``,
    with the job's storage options). ``trigger_interval``: minimum seconds between two
    planned batches (unbounded mode); ``poll_interval``: seconds between ``latestOffset``
    calls while there is no new data. ``batch_size``: rows per emitted Arrow batch.
    """

    def __init__(
        self,
        data_source: Any,
        options: Mapping[str, Any] | None = None,
        *,
        schema: Any = None,
        log: str | None = None,
        log_options: Mapping[str, Any] | None = None,
        num_splits: int = 4,
        bounded: bool = False,
        batch_size: int = 4096,
        trigger_interval: float = 0.2,
        poll_interval: float = 0.1,
    ) -> None:
        from pyspark.sql.datasource import DataSource, DataSourceStreamReader

        what = "SparkStreamSource"
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise ConfigError(f"{what}: num_splits must be an int >= 1, got {num_splits!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"{what}: batch_size must be an int >= 1, got {batch_size!r}")
        if trigger_interval < 0 or poll_interval <= 0:
            raise ConfigError(f"{what}: trigger_interval must be >= 0 and poll_interval > 0")
        if log is not None:
            _check_reachable(what, log, "log")
        self.data_source: Any = None
        self._reader_bytes: bytes | None = None
        if isinstance(data_source, type) and issubclass(data_source, DataSource):
            data_source = data_source(_options(options))
        if isinstance(data_source, DataSource):
            name = type(data_source).__name__
            if not (_overrides(data_source, "streamReader", DataSource)
                    or _overrides(data_source, "simpleStreamReader", DataSource)):
                raise ConfigError(
                    f"{what}: data source {name} implements neither streamReader(schema) nor "
                    "simpleStreamReader(schema); implement streamReader(schema) returning a "
                    "pyspark.sql.datasource.DataSourceStreamReader"
                )
            if schema is None:
                try:
                    schema = data_source.schema()
                except Exception as exc:  # noqa: BLE001 - PySparkNotImplementedError and friends
                    raise ConfigError(
                        f"{what}: data source {name} has no schema() ({type(exc).__name__}); "
                        "implement schema() or pass schema=..."
                    ) from exc
            self.data_source = data_source
            self.name = name
        elif isinstance(data_source, DataSourceStreamReader):
            if schema is None:
                raise ConfigError(
                    f"{what}: a DataSourceStreamReader instance needs schema= (a StructType, DDL string or "
                    "pyarrow.Schema); or pass the DataSource instead"
                )
            import cloudpickle

            try:
                self._reader_bytes = cloudpickle.dumps(data_source)
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(
                    f"{what}: the stream reader {type(data_source).__name__} cannot be pickled for the workers "
                    f"({exc}); pass its DataSource instead (readers are then built in each worker)"
                ) from exc
            self.name = type(data_source).__name__
        else:
            raise ConfigError(
                f"{what}: expected a pyspark.sql.datasource.DataSource (class or instance) or a "
                f"DataSourceStreamReader, got {type(data_source).__name__}"
            )
        self._struct, self._arrow_schema = _resolve_schema(schema, f"{what}({self.name})")
        self.num_splits = num_splits
        self.bounded = bool(bounded)
        self.batch_size = batch_size
        self.trigger_interval = float(trigger_interval)
        self.poll_interval = float(poll_interval)
        self.log_url = log
        self.log_options = dict(log_options) if log_options is not None else None
        self._log: _Log | None = None  # resolved by driver_open, shipped to the workers
        self._init_driver_state(data_source if self._reader_bytes is not None else None)

    def _init_driver_state(self, user_reader: Any) -> None:
        """Driver-only state: never pickled (threads, locks, the planning reader)."""
        self._drv_user_reader = user_reader
        self._drv_reader: Any = None
        self._drv_lock = threading.RLock()
        self._drv_stop: threading.Event | None = None
        self._drv_thread: threading.Thread | None = None
        self._drv_gen = 0
        self._drv_ends: dict[int, Any] = {}
        self._drv_committed = -1
        self._drv_oldest = 0
        self._drv_newest = -1
        self._drv_retention = _Retention()
        self._drv_commits: list[tuple[int, Any]] = []  # (batch, end) committed, for inspection

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of the emitted batches."""
        return self._arrow_schema

    def __repr__(self) -> str:
        return f"SparkStreamSource({self.name}, num_splits={self.num_splits}, bounded={self.bounded})"

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_drv_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        user_reader = None
        if self._reader_bytes is not None:
            import cloudpickle

            user_reader = cloudpickle.loads(self._reader_bytes)
        self._init_driver_state(user_reader)

    # -- Source
    def splits(self) -> list[str]:
        return [str(i) for i in range(self.num_splits)]

    def initial_offset(self, split: str) -> dict:
        return {"batch": 0, "partition": int(split), "row": 0}

    def create_reader(self, splits: Mapping[str, Any], subtask: int, parallelism: int) -> SourceReader:
        if self._log is None:
            raise ConfigError(
                "SparkStreamSource: the source was not opened in the driver (driver_open); run it with abs.run"
            )
        return _StreamLaneReader(self, splits)

    def _worker_reader(self) -> Any:
        if self._reader_bytes is not None:
            import cloudpickle

            return cloudpickle.loads(self._reader_bytes)
        return _make_stream_reader(self.data_source, self._struct)

    # -- driver side
    def driver_open(self, context: SourceContext) -> None:
        what = f"SparkStreamSource {context.uid!r}"
        log = _resolve_log_url(what, self.log_url, self.log_options, context, "log")
        self._log = log
        lanes = self.splits()
        restored = dict(context.restored_offsets or {})
        _check_restored_lanes(what, restored, lanes)
        fresh = context.attempt == 0 and not restored
        if fresh:
            log.wipe()
            self._drv_ends.clear()
            self._drv_committed = -1
        else:
            log.delete(log.path("_error.json"))
            committed = log.read_json(log.path("_committed.json"))
            if committed is not None:
                self._drv_committed = max(self._drv_committed, int(committed["batch"]))
        self._drv_retention.opened(context, _bound(restored, lanes) if restored else None, fresh, lanes)
        ids = sorted(int(m.group(1)) for m in map(_BATCH_FILE.match, log.names()) if m)
        self._drv_oldest = ids[0] if ids else 0
        self._drv_newest = ids[-1] if ids else -1
        if self._reader_bytes is None:
            self._drv_reader = _make_stream_reader(self.data_source, self._struct)
        else:
            self._drv_reader = self._drv_user_reader
        if ids:
            newest = log.read_json(log.path(_batch_name(ids[-1])))
            start, next_b = newest["end"], ids[-1] + 1
        else:
            with self._drv_lock:
                start, next_b = self._drv_reader.initialOffset(), 0
        self._drv_gen += 1
        self._drv_stop = threading.Event()
        self._drv_thread = threading.Thread(
            target=self._planner_main, args=(self._drv_gen, self._drv_stop, start, next_b),
            name=f"abs-spark-planner-{context.uid}", daemon=True,
        )
        self._drv_thread.start()

    def driver_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Any]) -> None:
        log = self._log
        bound = _bound(offsets, self.splits())
        if log is None or bound is None:
            return
        last = bound - 1
        if last > self._drv_committed and self._drv_reader is not None:
            end = self._batch_end(last)
            if end is not None:
                with self._drv_lock:
                    self._drv_reader.commit(end)
                self._drv_committed = last
                self._drv_commits.append((last, end))
                log.put(log.path("_committed.json"), json.dumps({"batch": last, "end": end}).encode())
        below = self._drv_retention.completed(bound)
        if below is not None:
            below = min(below, self._drv_newest)  # the newest logged batch always stays
            for b in range(self._drv_oldest, below):
                log.delete(log.path(_batch_name(b)))
                self._drv_ends.pop(b, None)
            self._drv_oldest = max(self._drv_oldest, below)

    def driver_close(self) -> None:
        stop, thread = self._drv_stop, self._drv_thread
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.join(30)
            if thread.is_alive():
                print(f"[abs] warning: {self!r}: the planner is still busy in the data source after 30 s",
                      file=sys.stderr)
        self._drv_thread = self._drv_stop = None
        reader, self._drv_reader = self._drv_reader, None
        if reader is not None and self._reader_bytes is None:
            try:
                with self._drv_lock:
                    reader.stop()
            except Exception as exc:  # noqa: BLE001 - closing never hides the job's own outcome
                print(f"[abs] warning: {self!r}: stop() failed: {exc}", file=sys.stderr)

    def _batch_end(self, b: int) -> Any:
        if b in self._drv_ends:
            return self._drv_ends[b]
        assert self._log is not None
        entry = self._log.read_json(self._log.path(_batch_name(b)))
        return None if entry is None else entry["end"]

    def _planner_main(self, gen: int, stop: threading.Event, start: Any, next_b: int) -> None:
        try:
            self._plan(gen, stop, start, next_b)
        except BaseException as exc:  # noqa: BLE001 - reported to the readers through the log
            if stop.is_set() or gen != self._drv_gen:
                return
            message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            print(f"[abs] {self!r}: the planner failed: {message}", file=sys.stderr)
            assert self._log is not None
            self._log.put(self._log.path("_error.json"), json.dumps({"error": message}).encode())

    def _plan(self, gen: int, stop: threading.Event, start: Any, next_b: int) -> None:
        from pyspark.sql.streaming.datasource import ReadAllAvailable

        log = self._log
        reader = self._drv_reader
        assert log is not None and reader is not None
        with self._drv_lock:
            limit = reader.getDefaultReadLimit() if hasattr(reader, "getDefaultReadLimit") else ReadAllAvailable()
        target: Any = None
        if self.bounded:
            if log.read_json(log.path("_end.json")) is not None:
                return
            native = _supports_available_now(reader)
            with self._drv_lock:
                if native is not None:
                    native.prepareForTriggerAvailableNow()
                else:
                    target = _latest(reader, start, ReadAllAvailable())
        last_planned = 0.0
        while not stop.is_set():
            if not self.bounded:
                delay = last_planned + self.trigger_interval - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    return
            with self._drv_lock:
                end = target if target is not None else _latest(reader, start, limit)
            if end is None or _canonical(end) == _canonical(start):
                if self.bounded:
                    log.put(log.path("_end.json"), json.dumps({"batches": next_b}).encode())
                    return
                stop.wait(self.poll_interval)
                continue
            with self._drv_lock:
                parts = list(reader.partitions(start, end))
            if parts:
                import cloudpickle

                entry = {
                    "v": 1, "batch": next_b, "start": start, "end": end, "planned_at": time.time(),
                    "partitions": [base64.b64encode(cloudpickle.dumps(p)).decode("ascii") for p in parts],
                }
                if stop.is_set() or gen != self._drv_gen:
                    return
                if not log.create(log.path(_batch_name(next_b)), json.dumps(entry).encode()):
                    raise SparkSourceError(
                        f"batch {next_b} already exists in {log.url}: another job or driver is planning into "
                        "the same log; give each job its own log= location"
                    )
                self._drv_ends[next_b] = end
                self._drv_newest = next_b
                next_b += 1
                last_planned = time.monotonic()
            start = end
            if target is not None:
                target = start  # wrapper mode: everything up to the target is planned


def _options(options: Mapping[str, Any] | None) -> Any:
    try:
        from pyspark.sql.datasource import CaseInsensitiveDict

        return CaseInsensitiveDict(dict(options or {}))
    except ImportError:  # pragma: no cover
        return dict(options or {})


def _batch_name(b: int) -> str:
    return f"batch-{b:012d}.json"


class _StreamLaneReader(_LaneReader):
    unit_key = "partition"

    def __init__(self, source: SparkStreamSource, splits: Mapping[str, Any]) -> None:
        assert source._log is not None
        super().__init__(source._log, splits, source.num_splits, f"SparkStreamSource({source.name})")
        self._src = source
        self._reader: Any = None

    def _fetch(self, batch: int) -> Any:
        entry = self._log.read_json(self._log.path(_batch_name(batch)))
        if entry is None:
            return None
        import pickle

        return [pickle.loads(base64.b64decode(p)) for p in entry["partitions"]]

    def _exists(self, batch: int) -> bool:
        return self._log.read(self._log.path(_batch_name(batch))) is not None

    def _open_unit(self, batch: int, units: Any, unit: int, skip: int) -> Iterator[pa.RecordBatch]:
        if self._reader is None:
            self._reader = self._src._worker_reader()
        items = self._reader.read(units[unit])
        return _arrow_chunks(iter(items), self._src._arrow_schema, self._src.batch_size, skip, self._what)


# --------------------------------------------------------------------------- SparkMicroBatchSource

_TRIGGERS = ("processingTime", "once", "availableNow")


class SparkMicroBatchSource(Source):
    """Any Spark Structured Streaming DataFrame as an exactly-once ABS source (micro-batch
    bridge, see the module docstring).

    ``streaming_df``: a streaming DataFrame (``spark.readStream...``) of the active session.
    ``staging``: directory (fsspec URL) for the staged micro-batches, reachable by every
    worker (default ``<storage>/sources/<uid>``). ``checkpoint_location``: Spark's
    ``checkpointLocation`` (a Hadoop path; default ``<staging>/_spark_checkpoint``, only for
    local staging). ``trigger``: keyword arguments of ``DataStreamWriter.trigger``
    (``{"processingTime": "1 second"}``, ``{"availableNow": True}``, ``{"once": True}``;
    ``None``: Spark's default, micro-batches as fast as possible); ``availableNow`` and
    ``once`` make the source bounded. Continuous triggers are refused (no micro-batches to
    stage). ``part_rows``: at most this many rows per staged Parquet part (a batch has at
    least ``min(rows, num_splits)`` parts, so every lane gets work).
    """

    unit_key = "part"

    def __init__(
        self,
        streaming_df: Any,
        staging: str | None = None,
        *,
        num_splits: int = 4,
        checkpoint_location: str | None = None,
        trigger: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        batch_size: int = 4096,
        part_rows: int = 65536,
    ) -> None:
        what = "SparkMicroBatchSource"
        if _active_session() is None:
            raise ConfigError(
                f"{what}: no active SparkSession; create one (SparkSession.builder...getOrCreate()) and build the "
                "streaming DataFrame with it before creating the source"
            )
        try:
            from pyspark.sql import DataFrame
        except ImportError:  # pragma: no cover
            DataFrame = ()  # type: ignore[assignment]
        if not isinstance(streaming_df, DataFrame):
            raise ConfigError(
                f"{what}: expected a streaming pyspark DataFrame (spark.readStream...load()), "
                f"got {type(streaming_df).__name__}"
            )
        if not streaming_df.isStreaming:
            raise ConfigError(
                f"{what}: the DataFrame is not streaming (it comes from spark.read, not spark.readStream); "
                "build it with spark.readStream...; for batch data use FileSource or spark.readStream on the files"
            )
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise ConfigError(f"{what}: num_splits must be an int >= 1, got {num_splits!r}")
        if not isinstance(batch_size, int) or batch_size < 1 or not isinstance(part_rows, int) or part_rows < 1:
            raise ConfigError(f"{what}: batch_size and part_rows must be ints >= 1")
        trigger = dict(trigger or {})
        if "continuous" in trigger:
            raise ConfigError(
                f"{what}: trigger={trigger!r}: continuous processing has no micro-batches to stage; use "
                "{'processingTime': '1 second'}, {'availableNow': True} or {'once': True}"
            )
        unknown = set(trigger) - set(_TRIGGERS)
        if unknown or len(trigger) > 1:
            raise ConfigError(
                f"{what}: trigger={trigger!r}: give at most one of {list(_TRIGGERS)} "
                "(the keyword arguments of DataStreamWriter.trigger)"
            )
        if staging is not None:
            _check_reachable(what, staging, "staging")
        self.num_splits = num_splits
        self.staging = staging
        self.storage_options = dict(storage_options) if storage_options is not None else None
        self.checkpoint_location = checkpoint_location
        self.trigger = trigger
        self.bounded = bool(trigger.get("availableNow") or trigger.get("once"))
        self.batch_size = batch_size
        self.part_rows = part_rows
        self._log: _Log | None = None
        self._init_driver_state(streaming_df)

    def _init_driver_state(self, streaming_df: Any) -> None:
        """Driver-only state: never pickled (the DataFrame, the query, threads)."""
        self._drv_df = streaming_df
        self._drv_query: Any = None
        self._drv_watcher: threading.Thread | None = None
        self._drv_gen = 0
        self._drv_closing = False
        self._drv_stage_lock = threading.Lock()
        self._drv_high = -1  # highest batch id staged
        self._drv_consumed = 0  # batches below are consumed by every retained checkpoint and deleted
        self._drv_retention = _Retention()
        self._drv_checkpoint: str | None = None

    def __repr__(self) -> str:
        return f"SparkMicroBatchSource(num_splits={self.num_splits}, trigger={self.trigger})"

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_drv_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_driver_state(None)  # a copy cannot run the query: its DataFrame stays behind

    # -- Source
    def splits(self) -> list[str]:
        return [str(i) for i in range(self.num_splits)]

    def initial_offset(self, split: str) -> dict:
        return {"batch": 0, "part": int(split), "row": 0}

    def create_reader(self, splits: Mapping[str, Any], subtask: int, parallelism: int) -> SourceReader:
        if self._log is None:
            raise ConfigError(
                "SparkMicroBatchSource: the source was not opened in the driver (driver_open); run it with abs.run"
            )
        return _MicroBatchLaneReader(self, splits)

    # -- driver side
    def driver_open(self, context: SourceContext) -> None:
        what = f"SparkMicroBatchSource {context.uid!r}"
        if self._drv_df is None:
            raise ConfigError(
                f"{what}: this is an unpickled copy of the source, without its streaming DataFrame; "
                "run the original object (the query runs in the driver that built it)"
            )
        session = _active_session()
        if session is None:
            raise ConfigError(
                f"{what}: no active SparkSession in the driver (was it stopped?); the source runs its Spark query "
                "in the driver: keep the session alive while the job runs"
            )
        log = _resolve_log_url(what, self.staging, self.storage_options, context, "staging")
        self._log = log
        if self.checkpoint_location is not None:
            checkpoint = self.checkpoint_location
        elif log.local:
            checkpoint = log.path("_spark_checkpoint")
        else:
            raise ConfigError(
                f"{what}: staging {log.url!r} is not a local directory, so Spark's checkpoint cannot default "
                "below it; pass checkpoint_location= (a path Spark can write, e.g. s3a://bucket/prefix)"
            )
        self._drv_checkpoint = checkpoint
        lanes = self.splits()
        restored = dict(context.restored_offsets or {})
        _check_restored_lanes(what, restored, lanes)
        fresh = context.attempt == 0 and not restored
        if fresh:
            if self.checkpoint_location is not None and _spark_checkpoint_has_progress(checkpoint):
                raise ConfigError(
                    f"{what}: the job starts fresh (nothing restored) but Spark's checkpoint {checkpoint!r} already "
                    "has progress; delete it (or give another checkpoint_location), or restore the job's checkpoint"
                )
            log.wipe(extra=("_spark_checkpoint",) if self.checkpoint_location is None else ())
            self._drv_high, self._drv_consumed = -1, 0
        else:
            log.delete(log.path("_error.json"))
            consumed = log.read_json(log.path("_consumed.json"))
            if consumed is not None:
                self._drv_consumed = max(self._drv_consumed, int(consumed["below"]))
            ids = [int(m.group(1)) for m in map(_BATCH_DIR.match, log.names()) if m]
            self._drv_high = max([self._drv_high, *ids])
        self._drv_retention.opened(context, _bound(restored, lanes) if restored else None, fresh, lanes)
        if log.read_json(log.path("_end.json")) is not None:
            return  # a bounded query that already finished: nothing to start
        self._drv_gen += 1
        self._drv_closing = False
        gen = self._drv_gen

        def stage(df: Any, batch_id: int) -> None:
            if gen != self._drv_gen or self._drv_closing:
                raise SparkSourceError("the ABS job attempt that started this query has ended")
            with self._drv_stage_lock:
                self._stage(df, int(batch_id))

        writer = self._drv_df.writeStream.foreachBatch(stage).option("checkpointLocation", checkpoint)
        if self.trigger:
            writer = writer.trigger(**self.trigger)
        try:
            query = writer.start()
        except Exception as exc:  # noqa: BLE001 - Spark's analysis errors
            raise ConfigError(f"{what}: the streaming query cannot start: {exc}") from exc
        self._drv_query = query
        self._drv_watcher = threading.Thread(
            target=self._watch, args=(query, gen), name=f"abs-spark-query-{context.uid}", daemon=True
        )
        self._drv_watcher.start()

    def driver_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Any]) -> None:
        log = self._log
        bound = _bound(offsets, self.splits())
        if log is None or bound is None:
            return
        below = self._drv_retention.completed(bound)
        if below is None or below <= self._drv_consumed:
            return
        old = self._drv_consumed
        self._drv_consumed = below
        log.put(log.path("_consumed.json"), json.dumps({"below": below}).encode())
        names = set(log.names())
        for b in range(old, below):
            if _stage_dir(b) in names:
                log.delete(log.path(_stage_dir(b)), recursive=True)

    def driver_close(self) -> None:
        self._drv_closing = True
        query, self._drv_query = self._drv_query, None
        if query is not None:
            try:
                query.stop()
            except Exception as exc:  # noqa: BLE001 - closing never hides the job's own outcome
                print(f"[abs] warning: {self!r}: stopping the Spark query failed: {exc}", file=sys.stderr)
        watcher, self._drv_watcher = self._drv_watcher, None
        if watcher is not None:
            watcher.join(60)
        # a foreachBatch call still running finishes (or fails) before the next attempt starts
        if self._drv_stage_lock.acquire(timeout=60):
            self._drv_stage_lock.release()

    def _watch(self, query: Any, gen: int) -> None:
        error: str | None = None
        try:
            query.awaitTermination()
            exc = query.exception()
            if exc is not None:
                error = str(exc)
        except Exception as exc:  # noqa: BLE001 - StreamingQueryException and py4j errors
            error = f"{type(exc).__name__}: {exc}"
        if self._drv_closing or gen != self._drv_gen:
            return
        log = self._log
        assert log is not None
        if error is None and not self.bounded:
            error = "the Spark streaming query stopped although its trigger is unbounded (was it stopped by hand?)"
        if error is not None:
            print(f"[abs] {self!r}: the Spark query failed: {error}", file=sys.stderr)
            log.put(log.path("_error.json"), json.dumps({"error": f"Spark query failed: {error}"}).encode())
            return
        batches = max(self._drv_high + 1, self._drv_consumed)
        log.put(log.path("_end.json"), json.dumps({"batches": batches}).encode())

    def _stage(self, df: Any, batch_id: int) -> None:
        """Stage micro-batch ``batch_id`` durably (idempotent by batch id)."""
        import pyarrow.parquet as pq

        log = self._log
        assert log is not None
        if batch_id < self._drv_consumed:
            return  # replayed by Spark after its staged copy was consumed and deleted
        manifest_path = log.path(_stage_dir(batch_id), "_manifest.json")
        if log.read(manifest_path) is not None:
            self._drv_high = max(self._drv_high, batch_id)
            return  # staged before (a replay): keep that content
        table = df.toArrow()
        rows = table.num_rows
        nparts = 0 if rows == 0 else min(rows, max(self.num_splits, -(-rows // self.part_rows)))
        token = uuid.uuid4().hex
        parts = []
        for k in range(nparts):
            lo, hi = rows * k // nparts, rows * (k + 1) // nparts
            out = io.BytesIO()
            pq.write_table(table.slice(lo, hi - lo), out)
            name = f"part-{k:05d}-{token}.parquet"
            log.put(log.path(_stage_dir(batch_id), name), out.getvalue())
            parts.append({"file": name, "rows": hi - lo})
        manifest = {"v": 1, "batch": batch_id, "rows": rows, "parts": parts, "staged_at": time.time(),
                    "schema": str(table.schema)}
        if not log.create(manifest_path, json.dumps(manifest).encode()):
            for p in parts:  # another staging of this batch id won; ours is garbage
                log.delete(log.path(_stage_dir(batch_id), p["file"]))
        self._drv_high = max(self._drv_high, batch_id)


def _stage_dir(b: int) -> str:
    return f"batch-{b:012d}"


def _spark_checkpoint_has_progress(location: str) -> bool:
    try:
        from fsspec.core import url_to_fs

        url = location.replace("s3a://", "s3://", 1)
        fs, path = url_to_fs(url)
        return bool(fs.ls(path.rstrip("/") + "/commits", detail=False))
    except Exception:  # noqa: BLE001 - missing or unreadable: treat as empty
        return False


class _MicroBatchLaneReader(_LaneReader):
    unit_key = "part"

    def __init__(self, source: SparkMicroBatchSource, splits: Mapping[str, Any]) -> None:
        assert source._log is not None
        super().__init__(source._log, splits, source.num_splits, "SparkMicroBatchSource")
        self._src = source

    def _fetch(self, batch: int) -> Any:
        manifest = self._log.read_json(self._log.path(_stage_dir(batch), "_manifest.json"))
        return None if manifest is None else manifest["parts"]

    def _exists(self, batch: int) -> bool:
        return self._log.read(self._log.path(_stage_dir(batch), "_manifest.json")) is not None

    def _open_unit(self, batch: int, units: Any, unit: int, skip: int) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        path = self._log.path(_stage_dir(batch), units[unit]["file"])
        data = self._log.read(path)
        if data is None:
            raise SparkSourceError(
                f"SparkMicroBatchSource: staged part {path} is missing; something deleted the staging directory"
            )
        table = pq.read_table(io.BytesIO(data))
        if skip:
            table = table.slice(skip)
        return iter(table.to_batches(max_chunksize=self._src.batch_size))
