"""Offline rewrites of snapshots with Spark: compact a checkpoint into a savepoint, or re-key
it into a new ``max_parallelism``.

::

    import recovery.spark
    recovery.spark.compact(spark, "/data/ckpt", 42, "/data/sp-42")
    recovery.spark.rekey(spark, "/data/ckpt", 42, "/data/sp-42-256", max_parallelism=256)
    abs.run(Dataflow("counts", max_parallelism=256) ..., restore="/data/sp-42-256", storage=...)

or from the shell: ``abs-snapshot savepoint ROOT ID DEST --spark`` and
``abs-snapshot rekey ROOT ID DEST --max-parallelism N --spark [--master URL]``.

Design
======
**Input partitioning.** The driver reads the checkpoint's manifest only (never a state file)
and lists one task item per (operator, state, key group) with its chain. Consecutive items
are packed into Spark partitions by file bytes (~32 MiB each, at most 256; the rule of the
``abs-snapshot`` data source, :func:`storage.spark.auto_partition_count`) or by a fixed
``key_groups_per_task``. Each Spark task opens the source root itself (a
:class:`~storage.SnapshotStore` per Python worker, with the storage options) and resolves its
chains with :meth:`~storage.SnapshotStore.read_chain`, which verifies every file's size and
checksum and applies the deltas in order (deletes drop keys).

**compact.** The key groups are cut into the runs the in-process savepoint packs together
(:func:`storage.savepoint.savepoint_packs`: per state, consecutive key groups of up to 8 MiB of
chain bytes), and each task takes whole runs (``key_groups_per_task`` joins runs up to that many
key groups; a larger run is a task of its own). It writes one base per key group it resolved,
packed per run as a checkpoint packs them, and returns the :class:`~storage.FileRef` (ranges
of the packed files); the bases are byte-identical to those of
:func:`storage.savepoint.take_savepoint`, and a key group whose keys were all deleted gets an
empty base in both.

**rekey.** Stage 1 (one task per input partition): resolve the chain, hash every live key with
:func:`abs.keygroups.stable_hashes` (vectorized for typed int / string / binary keys; pickled
keys are unpickled inside the task only, and only with ``unpickle=True`` / ``--unpickle``:
unpickling runs code from the snapshot), check that it hashes to its old key group under the
old ``max_parallelism`` (else the snapshot is refused as corrupt), and emit one record per
(operator, state, new key group) holding those rows as an Arrow IPC stream. The records are
shuffled with ``repartitionAndSortWithinPartitions``: a partitioner sends contiguous ranges of
new key groups to each output partition, sorted by (operator, state, new key group), so stage
2 merges one new key group at a time and writes its base. No row reaches the driver; it only
collects the file references. Old key groups whose keys were stored with different Arrow
types (or pickled) merge with pickled keys, as the runtime would encode such a key group.

**Commit point.** The driver copies the operator-state and channel-log files (byte for byte,
checksums verified), writes ``_job.json`` (the source's, with the new ``max_parallelism`` and
``rekeyed_from``), then the manifest (``kind = "savepoint"``, same checkpoint id, the source's
source offsets, sink transactions and operator-state rules unchanged). Only the manifest makes
the savepoint exist: a failed or interrupted rewrite leaves unreferenced files and no
manifest, and a retried Spark task writes fresh file names (the files of failed attempts are
garbage ``abs-snapshot gc DEST --retain 1 --job-stopped`` removes). The destination must be
empty; executors must reach both roots (``memory://`` is refused).

The result restores like any savepoint: ``abs.run(flow, restore=DEST, storage=NEW_ROOT)``; after
a re-key only a job declaring the new ``max_parallelism`` passes :func:`recovery.check`.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, TypeVar

from abscore.errors import AbsError
from abscore.progress import ProgressCallback, ProgressEvent
from storage import Manifest
from storage import errors as storage_errors
from storage.extras import install_hint
from storage.format import DEFAULT_DECODE_LIMITS, DecodeLimits

from . import errors as recovery_errors
from . import rewrite
from .rewrite import (
    DestinationNotEmptyError,
    ExecutorStorageError,
    KeyGroupTask,
    MaxParallelismError,
    RewriteContext,
    RewriteError,
    RewriteInputError,
    RewriteJob,
    SparkNotInstalledError,
    UnpickleRefusedError,
    plan_rewrite,
)

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

__all__ = [
    "compact",
    "rekey",
    "plan",
    "execute",
    "spark_session",
    "require_pyspark",
    "RewriteError",
    "RewriteInputError",
    "DestinationNotEmptyError",
    "ExecutorStorageError",
    "SparkNotInstalledError",
    "MaxParallelismError",
    "UnpickleRefusedError",
]

T = TypeVar("T")


# ============================================================================ public API
def compact(
    spark: "SparkSession",
    root: str,
    checkpoint_id: int,
    dest: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    key_groups_per_task: int | None = None,
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Write checkpoint ``checkpoint_id`` of ``root`` as a self-contained savepoint into the
    empty root ``dest``, resolving every chain into a base on the Spark executors.

    ``dest_storage_options=None``: a ``dest`` of the same protocol uses ``storage_options``.
    ``key_groups_per_task=None`` packs key groups into tasks by bytes. Returns the committed
    savepoint manifest (``stats["rewrite"]`` has the engine, task count and seconds).
    ``progress``: see :func:`execute`.
    """
    job = plan(root, checkpoint_id, dest, storage_options=storage_options,
               dest_storage_options=dest_storage_options)
    return execute(spark, job, key_groups_per_task=key_groups_per_task, progress=progress)


def rekey(
    spark: "SparkSession",
    root: str,
    checkpoint_id: int,
    dest: str,
    *,
    max_parallelism: int,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    key_groups_per_task: int | None = None,
    output_partitions: int | None = None,
    unpickle: bool = False,
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Write checkpoint ``checkpoint_id`` of ``root`` into the empty root ``dest`` as a
    savepoint whose keys are re-hashed into ``max_parallelism`` key groups (1..32768).

    ``unpickle``: pickled keys must be unpickled to be hashed again, which runs code from the
    snapshot; without ``unpickle=True`` a state with pickled keys raises
    :class:`UnpickleRefusedError` and nothing is committed.

    ``output_partitions``: Spark partitions of the shuffle (default: as many as input
    partitions). Returns the committed savepoint manifest; ``_job.json`` and the manifest
    carry the new ``max_parallelism``. ``progress``: see :func:`execute`.
    """
    job = plan(root, checkpoint_id, dest, max_parallelism=max_parallelism, storage_options=storage_options,
               dest_storage_options=dest_storage_options, unpickle=unpickle)
    return execute(spark, job, key_groups_per_task=key_groups_per_task, output_partitions=output_partitions,
                   progress=progress)


def plan(
    root: str,
    checkpoint_id: int,
    dest: str,
    *,
    max_parallelism: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    unpickle: bool = False,
    decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS,
) -> RewriteJob:
    """Check the inputs of a Spark rewrite and plan it, before any Spark session is needed
    (``max_parallelism=None``: compact; ``unpickle``: see :func:`rekey`; ``decode_limits``:
    see :class:`storage.format.DecodeLimits`). Raises
    :class:`RewriteInputError` subclasses, :class:`storage.errors.CheckpointNotFoundError`
    and storage errors."""
    return plan_rewrite(root, checkpoint_id, dest, max_parallelism=max_parallelism,
                        storage_options=storage_options, dest_storage_options=dest_storage_options, for_spark=True,
                        unpickle=unpickle, decode_limits=decode_limits)


def execute(
    spark: "SparkSession",
    job: RewriteJob,
    *,
    key_groups_per_task: int | None = None,
    output_partitions: int | None = None,
    progress: ProgressCallback | None = None,
) -> Manifest:
    """Run a planned rewrite on ``spark`` and commit it; returns the savepoint manifest.
    ``progress`` hears of each Spark stage of the rewrite as it runs (tasks done of its
    tasks; stage ``"<kind>: Spark stage <id> (<operation>)"``), from the driver's status tracker."""
    if output_partitions is not None and (type(output_partitions) is not int or output_partitions < 1):
        raise RewriteInputError(f"output_partitions={output_partitions!r}; use an integer >= 1 or None")
    # a compact writes whole savepoint packs per task (the bytes of the in-process savepoint)
    groups: list[Any] = (rewrite.group_packs(job.tasks, key_groups_per_task) if job.kind == "compact"
                         else rewrite.group_tasks(job.tasks, key_groups_per_task))
    if not groups:  # no keyed state: nothing for Spark to do
        return rewrite.finish(job, [], engine="spark", tasks=0)
    job.started = time.monotonic()
    what = f"{job.kind} of checkpoint {job.context.checkpoint_id} of {job.context.root} into {job.context.dest}"
    sc = spark.sparkContext
    sc.setJobDescription(f"abs-snapshot {what}")
    try:
        with _StageProgress(sc, job.kind, progress):
            if job.kind == "compact":
                refs = _run(what, lambda: _compact_rdd(sc, job.context, groups).collect())
                tasks = len(groups)
            else:
                outputs = _output_partitions(job, len(groups), output_partitions)
                refs = _run(what, lambda: _rekey_rdd(sc, job, groups, outputs).collect())
                tasks = len(groups) + outputs
    finally:
        sc.setJobDescription(None)  # type: ignore[arg-type]
    return rewrite.finish(job, refs, engine="spark", tasks=tasks)


class _StageProgress:
    """Reports the stages of the Spark jobs run inside it to ``progress``: it tags them with a
    job group of their own and polls the driver's status tracker every ``interval`` seconds
    in a thread, and once more at the end, so that every stage reports its last count even if
    it ran between two polls. Nothing without a callback."""

    def __init__(self, sc: Any, kind: str, progress: ProgressCallback | None, interval: float = 0.25) -> None:
        import threading
        import uuid

        self.sc, self.kind, self.progress, self.interval = sc, kind, progress, interval
        self.group = f"abs-snapshot-{kind}-{uuid.uuid4().hex[:12]}"
        self._last: dict[int, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abs-spark-progress", daemon=True)

    def __enter__(self) -> "_StageProgress":
        if self.progress is not None:
            self.sc.setLocalProperty("spark.jobGroup.id", self.group)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is None:
            return
        self._stop.set()
        self._thread.join()
        self.sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - progress must never fail the rewrite
                return

    def poll(self) -> None:
        tracker = self.sc.statusTracker()
        stages = sorted({sid for jid in tracker.getJobIdsForGroup(self.group) or ()
                         for sid in getattr(tracker.getJobInfo(jid), "stageIds", ()) or ()})
        for sid in stages:
            info = tracker.getStageInfo(sid)
            if info is None or not info.numTasks:
                continue
            now = (int(info.numCompletedTasks), int(info.numTasks))
            if self._last.get(sid) != now:
                self._last[sid] = now
                operation = str(info.name).split(" at ")[0]
                assert self.progress is not None
                self.progress(ProgressEvent(f"{self.kind}: Spark stage {sid} ({operation})", now[0], now[1], "tasks"))


# ============================================================================ the Spark jobs
def _compact_rdd(sc: Any, ctx: RewriteContext, groups: list[list[list[KeyGroupTask]]]) -> Any:
    return sc.parallelize(groups, len(groups)).mapPartitions(functools.partial(_compact_partition, ctx))


def _compact_partition(ctx: RewriteContext, groups: Iterator[list[list[KeyGroupTask]]]) -> Iterator[Any]:
    for group in groups:
        yield from rewrite.compact_group(ctx, group)


def _rekey_rdd(sc: Any, job: RewriteJob, groups: list[list[KeyGroupTask]], outputs: int) -> Any:
    ctx = job.context
    split = sc.parallelize(groups, len(groups)).mapPartitions(functools.partial(_split_partition, ctx))
    partitioner = _TargetPartitioner(job.states, ctx.new_max_parallelism, outputs)
    shuffled = split.repartitionAndSortWithinPartitions(outputs, partitioner)
    return shuffled.mapPartitions(functools.partial(_write_partition, ctx))


def _split_partition(ctx: RewriteContext, groups: Iterator[list[KeyGroupTask]]) -> Iterator[Any]:
    for group in groups:
        for target, part in rewrite.split_group(ctx, group):
            yield target, rewrite.to_ipc(part)


def _write_partition(ctx: RewriteContext, records: Iterator[tuple[tuple[str, str, int], bytes]]) -> Iterator[Any]:
    """Records arrive sorted by target: one new key group at a time."""
    for target, items in itertools.groupby(records, key=operator.itemgetter(0)):
        yield rewrite.write_rekeyed(ctx, target, (rewrite.from_ipc(payload) for _, payload in items))


def _output_partitions(job: RewriteJob, input_partitions: int, requested: int | None) -> int:
    targets = len(job.states) * job.context.new_max_parallelism
    return max(1, min(requested if requested is not None else input_partitions, targets))


class _TargetPartitioner:
    """(operator, state, new key group) -> output partition: contiguous ranges of new key
    groups (state after state), so each output task writes neighbouring key groups."""

    def __init__(self, states: list[tuple[str, str]], max_parallelism: int, partitions: int) -> None:
        self.index = {state: i for i, state in enumerate(states)}
        self.max_parallelism = max_parallelism
        self.partitions = partitions

    def __call__(self, target: tuple[str, str, int]) -> int:
        op, st, kg = target
        slot = self.index[(op, st)] * self.max_parallelism + kg
        return slot * self.partitions // (len(self.index) * self.max_parallelism)


# ============================================================================ task errors
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$")


def _run(what: str, action: Callable[[], T]) -> T:
    """Run a Spark action; a failed Python task is raised again on the driver as the
    storage / recovery error it raised (same class and message) when it was one, else as
    :class:`RewriteError`, instead of a Java stack trace."""
    try:
        return action()
    except Exception as exc:
        if not type(exc).__module__.startswith(("py4j", "pyspark")):
            raise  # not a Spark failure: a storage error or a bug of this driver code
        raise _task_error(what, exc) from exc


def _task_error(what: str, exc: BaseException) -> AbsError:
    name, message = _last_python_error(str(exc))
    cls = _error_class(name) if name else None
    if cls is not None:
        try:
            return cls(message)
        except TypeError:  # a class with extra required arguments
            pass
    detail = f"{name}: {message}" if name else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return RewriteError(f"{what}: a Spark task failed ({detail}); nothing was committed; fix the cause, "
                        "delete the destination and run again")


def _last_python_error(text: str) -> tuple[str | None, str]:
    """The exception line of the (last) Python traceback in a Spark error message."""
    found: tuple[str | None, str] = (None, "")
    for line in text.splitlines():
        match = _PY_ERROR.match(line.strip())
        if match and not match.group(1).startswith(("org.", "java.", "py4j.", "scala.")):
            found = (match.group(1), match.group(2))
    return found


def _error_class(name: str) -> type[AbsError] | None:
    short = name.rsplit(".", 1)[-1]
    for module in (rewrite, recovery_errors, storage_errors):
        cls = getattr(module, short, None)
        if isinstance(cls, type) and issubclass(cls, AbsError):
            return cls
    return None


# ============================================================================ sessions (CLI)
def require_pyspark() -> None:
    """Raise :class:`SparkNotInstalledError` unless pyspark imports."""
    try:
        import pyspark  # noqa: F401
        from pyspark.sql import SparkSession  # noqa: F401
    except ImportError as exc:
        raise SparkNotInstalledError(
            f"--spark needs pyspark, which does not import in this Python ({sys.executable}: {exc}); "
            f"{install_hint('spark')} (Spark also needs Java 17), or run without --spark "
            "(in-process)"
        ) from exc


@contextlib.contextmanager
def spark_session(master: str = "local[*]", app_name: str = "abs-snapshot", *,
                  log_level: str = "FATAL") -> Iterator["SparkSession"]:
    """The active SparkSession if there is one (left running), else a new one on ``master``,
    stopped on exit. For ``local`` masters the executors run this Python
    (``PYSPARK_PYTHON = sys.executable``) and bind to loopback (``SPARK_LOCAL_IP``). A new
    session logs at ``log_level`` only and shows no progress bars: a failed task is reported
    by :func:`execute` as the Python error it raised."""
    require_pyspark()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    if master.startswith("local"):
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    session.sparkContext.setLogLevel(log_level)
    try:
        yield session
    finally:
        session.stop()
