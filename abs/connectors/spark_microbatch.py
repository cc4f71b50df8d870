"""Spark streaming DataFrames as barrier-injecting, exactly-once replayable ABS sources.

:class:`SparkMicroBatchSource`
    Wraps any Structured Streaming DataFrame (files, Kafka, rate, Delta...). ``driver_open``
    starts ``df.writeStream.foreachBatch(stage)`` with Spark's own ``checkpointLocation``.
    ``stage`` writes micro-batch ``b`` as Parquet parts into ``batch-<b>/`` and then its
    ``_manifest.json`` (create-if-absent: the first complete staging of a batch id wins, a
    replayed batch id keeps the content already staged) *before returning*, so before Spark
    commits the batch. Readers replay staged batches by id.

Who writes the Parquet parts (``stage_on``)
    ``"executors"`` (default): the micro-batch's own Spark tasks write their partitions'
    rows as parts (``DataFrame.mapInArrow``: each task splits its partition into parts of at
    most ``part_rows`` rows, and into enough parts that every lane gets work when the batch
    has fewer partitions than ``num_splits``); the driver collects only each part's name,
    rows and bytes and writes the manifest. A micro-batch is then bounded by the executors'
    memory, one partition per task, not by the driver's, and the staging must be reachable
    (writable) by the executors too. A retried or speculative task writes parts under
    another name; only the parts of the tasks Spark kept are in the manifest (the others
    go with the batch's directory). ``"driver"``: the driver collects each micro-batch
    (``DataFrame.toArrow``) and writes the parts itself, for a staging only the driver
    and the ABS workers reach; size micro-batches with the source's own limits
    (``maxFilesPerTrigger``, ``maxOffsetsPerTrigger``...).

Bounded mode
    ``SparkMicroBatchSource(..., trigger={"availableNow": True})`` (or ``{"once": True}``)
    ends when the query terminates by itself. The producer then writes ``_end.json`` durably
    and readers return END after the last batch.

Lag (for autoscaling)
    A reader's ``lag()`` is in **rows**: the rows staged for its lanes that it has not emitted
    yet, as of its last poll. Each manifest records the rows staged for every lane before its
    batch (``lanes_before``), and ``_staged.json`` the rows staged per lane up to the newest
    batch (rewritten after each staged batch); a reader reads that file at most twice a second.
    Rows Spark has not handed to ``foreachBatch`` yet (the backlog the bound on staged batches
    keeps upstream, see "Back-pressure" in :mod:`abs.connectors.batchlog`) are not counted:
    the lag of a reader held at the bound is the bound's worth of rows, which still asks for
    more capacity.

The staging directory, its lanes, offsets, deletion rule and restarts: :mod:`abs.connectors.batchlog`.

Example::

    import abs
    from abs.connectors.spark_microbatch import SparkMicroBatchSource

    df = spark.readStream.schema("id long, v string").json("/data/in")
    src = SparkMicroBatchSource(df, num_splits=4, trigger={"availableNow": True})
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Mapping

from storage.extras import require

from ..errors import ConfigError
from .batchlog import _BATCH_DIR, SparkSourceError, _check_reachable, _Log, _resolve_log_url, _stage_dir
from .batchlog_backlog import _Backlog, _bound, _check_bound, _check_restored_lanes, _Retention
from .batchlog_copies import _COPIED_MARKERS, _copy_files, _copy_tree, _savepoint_copy, _savepoint_log, _write_copy_marker
from .fs import absolute
from .sources import Source, SourceContext, SourceReader
from .spark_arrow import _active_session
from .spark_microbatch_reader import _MicroBatchLaneReader
from .spark_microbatch_staging import (_lanes_after, _spark_checkpoint_has_progress, _stage_data_source,
                                       _stage_on_executors, _write_parts)

__all__ = ["SparkMicroBatchSource", "SparkSourceError"]

log = logging.getLogger(__name__)


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
    ``stage_on``: ``"executors"`` (the query's tasks write the parts) or ``"driver"``
    (collected with ``toArrow``), see the module docstring.
    ``max_pending_batches`` / ``max_pending_bytes``: ``foreachBatch`` stages a micro-batch only
    while fewer batches, and fewer bytes of staged Parquet, than these are not yet read by
    every lane; otherwise it waits, which holds Spark's query back (``None``: no bound; see
    "Back-pressure" in :mod:`abs.connectors.batchlog`).
    """

    unit_key = "part"
    # the streaming query's tasks run on the job's own Spark application: a SparkExecutor must
    # leave them a task slot beside its barrier stage, or no micro-batch is ever staged
    spark_query_slots = 1

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
        max_pending_batches: int | None = 64,
        max_pending_bytes: int | None = 512 << 20,
        stage_on: str = "executors",
    ) -> None:
        what = "SparkMicroBatchSource"
        require("spark", what)
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
        if stage_on not in ("executors", "driver"):
            raise ConfigError(f"{what}: stage_on must be 'executors' or 'driver', got {stage_on!r}")
        self.stage_on = stage_on
        self.part_rows = part_rows
        self._uid = ""  # the source's uid in the job (driver_open)
        self.max_pending_batches = _check_bound(what, "max_pending_batches", max_pending_batches)
        self.max_pending_bytes = _check_bound(what, "max_pending_bytes", max_pending_bytes)
        self._progress_token: str | None = None  # set per attempt by driver_open, shipped to the readers
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
        self._drv_lane_rows: list[int] = [0] * self.num_splits  # rows staged per lane up to _drv_high
        self._drv_consumed = 0  # batches below are consumed by every retained checkpoint and deleted
        self._drv_retention = _Retention()
        self._drv_backlog = _Backlog()
        self._drv_bytes: dict[int, int] = {}  # staged bytes per batch id (for max_pending_bytes)
        self._drv_checkpoint: str | None = None
        self._drv_stage_source = ""  # name of the registered staging data source (stage_on="executors")
        self._drv_writers: set[str] = set()  # "host:pid" of the processes that wrote staged parts (inspection)

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
        self._uid = context.uid
        copy = _savepoint_copy(what, context, restored)
        if copy is not None:
            # restoring a savepoint that carries the staged batches and Spark's checkpoint it
            # needs: the staging and Spark's checkpoint location become those
            log.wipe(extra=("_spark_checkpoint",) if self.checkpoint_location is None else ())
            self._drv_high, self._drv_consumed = -1, 0
            names = copy.names()
            for b in sorted(int(m.group(1)) for m in map(_BATCH_DIR.match, names) if m):
                _copy_tree(copy, _stage_dir(b), log, _stage_dir(b), what)
            _copy_files(copy, log, [n for n in (*_COPIED_MARKERS, "_staged.json") if n in names], what)
            target = self._checkpoint_log(checkpoint)
            if self.checkpoint_location is not None:
                target.delete(target.root, recursive=True)
            _copy_tree(copy, "_spark_checkpoint", target, "", what)
        if fresh:
            if self.checkpoint_location is not None and _spark_checkpoint_has_progress(checkpoint):
                raise ConfigError(
                    f"{what}: the job starts fresh (nothing restored) but Spark's checkpoint {checkpoint!r} already "
                    "has progress; delete it (or give another checkpoint_location), or restore the job's checkpoint"
                )
            log.wipe(extra=("_spark_checkpoint",) if self.checkpoint_location is None else ())
            self._drv_high, self._drv_consumed = -1, 0
            self._drv_lane_rows = [0] * self.num_splits
        else:
            log.delete(log.path("_error.json"))
            consumed = log.read_json(log.path("_consumed.json"))
            if consumed is not None:
                self._drv_consumed = max(self._drv_consumed, int(consumed["below"]))
            ids = [int(m.group(1)) for m in map(_BATCH_DIR.match, log.names()) if m]
            self._drv_high = max([self._drv_high, *ids])
            self._drv_lane_rows = self._staged_rows(log, ids)
        self._drv_retention.opened(context, _bound(restored, lanes) if restored else None, fresh, lanes)
        self._progress_token = uuid.uuid4().hex
        self._drv_backlog.opened(lanes, restored, self._progress_token)
        self._drv_bytes.clear()
        if log.read_json(log.path("_end.json")) is not None:
            return  # a bounded query that already finished: nothing to start
        self._drv_gen += 1
        self._drv_closing = False
        gen = self._drv_gen
        if self.stage_on == "executors":
            self._drv_stage_source = f"abs_stage_{uuid.uuid4().hex[:16]}"
            session.dataSource.register(_stage_data_source(log, self._drv_stage_source, self.part_rows))

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
        self._drv_backlog.checkpointed(offsets)
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

    def driver_hold(self) -> Any:
        return self._drv_retention.hold()

    def driver_savepoint(self, offsets: Mapping[str, Any], dest: str, dest_options: Mapping[str, Any] | None) -> None:
        """Copy Spark's checkpoint, the staged batches ``offsets`` still needs and the markers
        into ``dest`` (see "Savepoints" in :mod:`abs.connectors.batchlog`)."""
        log = self._log
        bound = _bound(offsets, self.splits())
        if log is None or bound is None or self._drv_checkpoint is None:
            return
        what = f"{self!r}: savepoint {dest}"
        copy = _savepoint_log(dest, dest_options if dest_options is not None else log.options, self._uid)
        copy.wipe(extra=("_spark_checkpoint",))
        # no micro-batch is staged meanwhile: every batch Spark's checkpoint has committed is
        # staged, and Spark replays at most the one it had started (the same data)
        if not self._drv_stage_lock.acquire(timeout=300):
            raise SparkSourceError(f"{what}: a micro-batch has been staging for 5 minutes; take the savepoint later")
        try:
            _copy_tree(self._checkpoint_log(self._drv_checkpoint), "", copy, "_spark_checkpoint", what, temporary=True)
            names = log.names()
            markers = [n for n in _COPIED_MARKERS if n in names]
            batches = sorted(b for b in (int(m.group(1)) for m in map(_BATCH_DIR.match, names) if m)
                             if b >= bound and log.read(log.path(_stage_dir(b), "_manifest.json")) is not None)
            staged = log.read(log.path("_staged.json"))  # the rows of exactly these batches
        finally:
            self._drv_stage_lock.release()
        for b in batches:  # staged batches never change: copied outside the lock
            _copy_tree(log, _stage_dir(b), copy, _stage_dir(b), what)
        _copy_files(log, copy, markers, what)
        if staged is not None:
            copy.put(copy.path("_staged.json"), staged)
        _write_copy_marker(copy, offsets, batches)

    def _checkpoint_log(self, location: str) -> _Log:
        """Spark's checkpoint location (a Hadoop path) as a directory of files."""
        url = location.replace("s3a://", "s3://", 1)
        if url.startswith("file:") and not url.startswith("file://"):
            url = url[len("file:"):]
        return _Log(absolute(url), self._log.options if self._log is not None else self.storage_options)

    def driver_close(self) -> None:
        self._drv_closing = True
        query, self._drv_query = self._drv_query, None
        if query is not None:
            try:
                query.stop()
            except Exception as exc:  # noqa: BLE001 - closing never hides the job's own outcome
                log.warning("%r: stopping the Spark query failed: %s", self, exc)
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
        staging = self._log
        assert staging is not None
        if error is None and not self.bounded:
            error = "the Spark streaming query stopped although its trigger is unbounded (was it stopped by hand?)"
        if error is not None:
            log.error("%r: the Spark query failed: %s", self, error)
            staging.put(staging.path("_error.json"), json.dumps({"error": f"Spark query failed: {error}"}).encode())
            return
        batches = max(self._drv_high + 1, self._drv_consumed)
        staging.put(staging.path("_end.json"), json.dumps({"batches": batches}).encode())

    def _stage(self, df: Any, batch_id: int) -> None:
        """Stage micro-batch ``batch_id`` durably (idempotent by batch id)."""

        log = self._log
        assert log is not None
        if batch_id < self._drv_consumed:
            return  # replayed by Spark after its staged copy was consumed and deleted
        manifest_path = log.path(_stage_dir(batch_id), "_manifest.json")
        if log.read(manifest_path) is not None:
            self._drv_high = max(self._drv_high, batch_id)
            return  # staged before (a replay): keep that content
        gen = self._drv_gen

        def stop_waiting(seconds: float) -> bool:
            time.sleep(seconds)
            return self._drv_closing or gen != self._drv_gen

        if not self._drv_backlog.wait_for_room(log, batch_id, self.max_pending_batches, self.max_pending_bytes,
                                               self._staged_bytes, stop_waiting):
            raise SparkSourceError("the ABS job attempt that started this query has ended")
        if self.stage_on == "executors":
            parts = _stage_on_executors(_active_session(), df, self._drv_stage_source, log, _stage_dir(batch_id),
                                        self.num_splits)
            self._publish(batch_id, parts, df.schema.simpleString())
            return
        table = df.toArrow()
        rows = table.num_rows
        nparts = 0 if rows == 0 else min(rows, max(self.num_splits, -(-rows // self.part_rows)))
        token = uuid.uuid4().hex
        parts = _write_parts(log, _stage_dir(batch_id), table, nparts, lambda k: f"part-{k:05d}-{token}.parquet")
        self._publish(batch_id, parts, str(table.schema))

    def _publish(self, batch_id: int, parts: list[dict], schema: str) -> None:
        """Write batch ``batch_id``'s manifest (create-if-absent: the first staging wins),
        then the rows staged per lane (``_staged.json``)."""
        log = self._log
        assert log is not None
        manifest_path = log.path(_stage_dir(batch_id), "_manifest.json")
        before = list(self._drv_lane_rows)
        manifest = {"v": 1, "batch": batch_id, "rows": sum(p["rows"] for p in parts), "parts": parts,
                    "staged_at": time.time(), "schema": schema, "bytes": sum(p["bytes"] for p in parts),
                    "lanes_before": before}
        if not log.create(manifest_path, json.dumps(manifest).encode()):
            for p in parts:  # another staging of this batch id won; ours is garbage
                log.delete(log.path(_stage_dir(batch_id), p["file"]))
            self._drv_high = max(self._drv_high, batch_id)
            return
        self._drv_bytes[batch_id] = manifest["bytes"]
        self._drv_writers.update(p["writer"] for p in parts if "writer" in p)
        self._drv_high = max(self._drv_high, batch_id)
        self._drv_lane_rows = _lanes_after(manifest, self.num_splits)
        log.put(log.path("_staged.json"), json.dumps({"batch": batch_id, "lane_rows": self._drv_lane_rows}).encode())

    def _staged_rows(self, log: _Log, ids: list[int]) -> list[int]:
        """Rows staged per lane so far, after a restart: ``_staged.json``, or the newest
        manifest if the driver stopped between the two writes."""
        n = self.num_splits
        staged = log.read_json(log.path("_staged.json"))
        rows, at = (list(staged["lane_rows"]), int(staged["batch"])) if staged else ([0] * n, -1)
        newest = max([b for b in ids if b > at], default=None)
        if newest is not None:
            manifest = log.read_json(log.path(_stage_dir(newest), "_manifest.json"))
            if manifest is not None and "lanes_before" in manifest:
                rows = _lanes_after(manifest, n)
        return rows if len(rows) == n else [0] * n

    def _staged_bytes(self, low: int, high: int) -> int:
        """Bytes of the staged batches ``low .. high - 1`` (manifests of batches staged by an
        earlier driver are read once)."""
        log = self._log
        assert log is not None
        total = 0
        for b in range(max(low, self._drv_consumed), high):
            if b not in self._drv_bytes:
                manifest = log.read_json(log.path(_stage_dir(b), "_manifest.json"))
                self._drv_bytes[b] = 0 if manifest is None else int(
                    manifest.get("bytes", sum(int(p.get("bytes", 0)) for p in manifest["parts"])))
            total += self._drv_bytes[b]
        for b in [k for k in self._drv_bytes if k < low]:
            del self._drv_bytes[b]
        return total
