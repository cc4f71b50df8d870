"""PySpark Python data sources (stream readers) as barrier-injecting, exactly-once replayable
ABS sources.

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

Bounded mode
    ``SparkStreamSource(..., bounded=True)`` is Spark's ``availableNow``: a reader that
    implements ``SupportsTriggerAvailableNow`` gets ``prepareForTriggerAvailableNow()`` and is
    planned with its default read limit until ``latestOffset`` returns its start; any other
    reader is planned as one batch up to ``latestOffset(start, ReadAllAvailable())`` (what
    Spark's wrapper does). The planner then writes ``_end.json`` durably and readers return
    END after the last batch.

Lag
    The readers' ``lag()`` is ``None``: the rows of a planned partition are known only once it is
    read, and the data source's offsets have no common unit (SparkMicroBatchSource's readers do
    report one, in rows).

The batch log, its lanes, offsets, deletion rule and restarts: :mod:`abs.connectors.batchlog`.

Example::

    import abs
    from abs.connectors.spark_stream import SparkStreamSource

    flow = abs.Dataflow("events")
    src = SparkStreamSource(MyDataSource, {"topic": "t"}, num_splits=4)
    flow.source("src", src).map(lambda r: r).sink("out", abs.CollectSink())
    abs.run(flow, parallelism=2, checkpoint=abs.CheckpointConfig(interval=1.0), storage="./snap")
"""
from __future__ import annotations

import base64
import inspect
import json
import logging
import threading
import time
import traceback
import uuid
from typing import Any, Mapping

import pyarrow as pa

from storage.extras import require

from ..errors import ConfigError
from .batchlog import (
    _BATCH_FILE,
    SparkSourceError,
    _batch_name,
    _canonical,
    _check_reachable,
    _Log,
    _resolve_log_url,
)
from .batchlog_backlog import _Backlog, _bound, _check_bound, _check_restored_lanes, _Retention
from .batchlog_copies import _COPIED_MARKERS, _copy_files, _savepoint_copy, _savepoint_log, _write_copy_marker
from .sources import Source, SourceContext, SourceReader
from .spark_arrow import _resolve_schema
from .spark_stream_reader import _StreamLaneReader

__all__ = ["SparkStreamSource", "SparkSourceError"]

log = logging.getLogger(__name__)


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
    ``max_pending_batches``: the planner plans a batch only while fewer than this many logged
    batches are not yet read by every lane (``None``: no bound; see "Back-pressure" in
    :mod:`abs.connectors.batchlog`).
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
        max_pending_batches: int | None = 64,
    ) -> None:
        what = "SparkStreamSource"
        require("spark", what)
        from pyspark.sql.datasource import DataSource, DataSourceStreamReader

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
        self.max_pending_batches = _check_bound(what, "max_pending_batches", max_pending_batches)
        self._progress_token: str | None = None  # set per attempt by driver_open, shipped to the readers
        self.log_url = log
        self.log_options = dict(log_options) if log_options is not None else None
        self._log: _Log | None = None  # resolved by driver_open, shipped to the workers
        self._uid = ""  # the source's uid in the job (driver_open)
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
        self._drv_backlog = _Backlog()
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
        self._uid = context.uid
        lanes = self.splits()
        restored = dict(context.restored_offsets or {})
        _check_restored_lanes(what, restored, lanes)
        fresh = context.attempt == 0 and not restored
        copy = _savepoint_copy(what, context, restored)
        if fresh or copy is not None:
            log.wipe()
            self._drv_ends.clear()
            self._drv_committed = -1
        if copy is not None:  # restoring a savepoint that carries the log it needs: that log it is
            names = copy.names()
            _copy_files(copy, log, sorted(n for n in names if _BATCH_FILE.match(n)), what)
            _copy_files(copy, log, [n for n in _COPIED_MARKERS if n in names], what)
        if not fresh:
            log.delete(log.path("_error.json"))
            committed = log.read_json(log.path("_committed.json"))
            if committed is not None:
                self._drv_committed = max(self._drv_committed, int(committed["batch"]))
        self._drv_retention.opened(context, _bound(restored, lanes) if restored else None, fresh, lanes)
        self._progress_token = uuid.uuid4().hex
        self._drv_backlog.opened(lanes, restored, self._progress_token)
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
        self._drv_backlog.checkpointed(offsets)
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

    def driver_hold(self) -> Any:
        return self._drv_retention.hold()

    def driver_savepoint(self, offsets: Mapping[str, Any], dest: str, dest_options: Mapping[str, Any] | None) -> None:
        """Copy the logged batches ``offsets`` still needs, and the markers, into ``dest``
        (see "Savepoints" in :mod:`abs.connectors.batchlog`)."""
        log = self._log
        bound = _bound(offsets, self.splits())
        if log is None or bound is None:
            return
        what = f"{self!r}: savepoint {dest}"
        copy = _savepoint_log(dest, dest_options if dest_options is not None else log.options, self._uid)
        copy.wipe()
        names = log.names()
        markers = [n for n in _COPIED_MARKERS if n in names]  # before the batches: _end names logged ones
        ids = sorted(int(m.group(1)) for m in map(_BATCH_FILE.match, names) if m)
        # the newest logged batch too, even if read: a restored planner continues after it
        batches = [b for b in ids if b >= min(bound, ids[-1])] if ids else []
        _copy_files(log, copy, [_batch_name(b) for b in batches], what)
        _copy_files(log, copy, markers, what)
        _write_copy_marker(copy, offsets, batches)

    def driver_close(self) -> None:
        stop, thread = self._drv_stop, self._drv_thread
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.join(30)
            if thread.is_alive():
                log.warning("%r: the planner is still busy in the data source after 30 s", self)
        self._drv_thread = self._drv_stop = None
        reader, self._drv_reader = self._drv_reader, None
        if reader is not None and self._reader_bytes is None:
            try:
                with self._drv_lock:
                    reader.stop()
            except Exception as exc:  # noqa: BLE001 - closing never hides the job's own outcome
                log.warning("%r: stop() failed: %s", self, exc)

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
            log.error("%r: the planner failed: %s", self, message)
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
            if not self._drv_backlog.wait_for_room(log, next_b, self.max_pending_batches, None, None, stop.wait):
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
