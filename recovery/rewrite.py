"""Offline rewrites of a checkpoint into a self-contained savepoint in an empty root: the
engine-independent core of :mod:`recovery.spark` (planning, the work of one task, the commit)
and an in-process re-key (:func:`rekey_local`) for states that fit in one process.

Two rewrites share this code:

- **compact**: every key group's chain (base + deltas) is resolved into one base in the same
  key group; the result equals :func:`storage.savepoint.take_savepoint` (same bytes per base).
- **re-key**: every chain is resolved (deletes applied), every live key is hashed again with
  :func:`abs.keygroups.stable_hashes` into the key groups of a new ``max_parallelism``, and the
  rows of each new key group become one base. ``_job.json`` and the manifest carry the new
  ``max_parallelism``, so a ``Dataflow(..., max_parallelism=new)`` restores from the result
  and the old job gets the ``max_parallelism`` mismatch of :func:`recovery.check`.

In both, operator-state and channel-log files are copied byte for byte (checksums verified),
source offsets, sink transactions and operator-state rules unchanged. Files are written by the
tasks; the driver writes ``_job.json`` and then the manifest, which is the commit point: until
it exists the destination holds no snapshot, whatever happened to the tasks.

Layering: ``recovery`` depends on ``storage`` and the floor ``abscore`` only; the re-key hashes
keys with :mod:`abscore.keygroups`, the key hash the runtime uses too.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import fsspec.core
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from abscore.keygroups import MAX_MAX_PARALLELISM, stable_hashes
from abscore.schema import ENCODING_ARROW, ENCODING_PICKLE, KEY_COLUMN, META_KEY_ENCODING, META_VALUE_ENCODING
from storage import FileRef, Manifest, SnapshotStore, StoragePaths
from storage.backend import protocols_of
from storage.savepoint import copy_unkeyed
from storage.errors import CorruptManifestError, StorageConfigError
from storage.manifest import manifest_problems
from storage.format import DEFAULT_DECODE_LIMITS, DecodeLimits, is_pickled

from .errors import ParallelismError, RecoveryError

if TYPE_CHECKING:  # pragma: no cover
    from numpy.typing import NDArray

__all__ = [
    "RewriteError",
    "RewriteInputError",
    "DestinationNotEmptyError",
    "ExecutorStorageError",
    "SparkNotInstalledError",
    "MaxParallelismError",
    "UnpickleRefusedError",
    "KeyGroupTask",
    "RewriteContext",
    "RewriteJob",
    "MAX_MAX_PARALLELISM",
    "plan_rewrite",
    "check_new_max_parallelism",
    "group_tasks",
    "compact_group",
    "split_group",
    "write_rekeyed",
    "to_ipc",
    "from_ipc",
    "finish",
    "rekey_local",
]

_KEY_PICKLE_PROTOCOL = 5  # what abs.state pickles keys with ("pickle protocol 5")
_SHUFFLE_CODEC = "lz4" if pa.Codec.is_available("lz4") else None
_SHUFFLE_WRITE = pa.ipc.IpcWriteOptions(compression=_SHUFFLE_CODEC)


# ============================================================================ errors
class RewriteError(RecoveryError):
    """An offline rewrite (compact / re-key) failed while reading, re-hashing or writing
    state: a key stored in the wrong key group, key groups whose schemas cannot be merged, a
    Spark task that failed. Nothing was committed: the destination holds no manifest.

    Remedy: the message names the file, state or key; fix the source (or restore from another
    checkpoint), delete the destination and run again.
    """


class RewriteInputError(RewriteError, StorageConfigError):
    """The rewrite was asked for something it cannot do (bad arguments); nothing was written."""


class DestinationNotEmptyError(RewriteInputError):
    """The destination already holds files (or is the source root). Remedy: pass a new, empty
    directory or prefix; ``abs-snapshot savepoint`` without ``--spark`` adds a savepoint to an
    existing root of the same job."""


class ExecutorStorageError(RewriteInputError):
    """A root the Spark executors cannot reach (``memory://`` lives inside one process).
    Remedy: use a path or URL every executor can open (local disk for ``local[*]``, S3, ...),
    or the in-process commands (without ``--spark``)."""


class SparkNotInstalledError(RewriteInputError):
    """``--spark`` was given but pyspark cannot be imported. Remedy: ``pip install
    'abs-snapshots[spark]'`` (and Java 17) in this Python, or run without ``--spark``."""


class MaxParallelismError(RewriteInputError, ParallelismError):
    """The new ``max_parallelism`` of a re-key is not an integer in ``[1, 32768]``."""


class UnpickleRefusedError(RewriteInputError):
    """A re-key met a state whose keys are pickled: hashing them again means unpickling them,
    which runs code from the snapshot, and the caller did not allow it. Nothing was written
    that a restore could see (no manifest).

    Remedy: if you trust the root, pass ``--unpickle`` (CLI) or ``unpickle=True`` (Python);
    otherwise do not re-key it. Compaction and savepoints never unpickle.
    """


# ============================================================================ plan
@dataclass(frozen=True)
class KeyGroupTask:
    """One key group of one keyed state of the source checkpoint, with its chain."""

    operator: str
    state: str
    key_group: int
    chain: tuple[FileRef, ...]

    @property
    def bytes(self) -> int:
        return sum(ref.bytes for ref in self.chain)


@dataclass(frozen=True)
class RewriteContext:
    """What every task needs (small and picklable: shipped to each Spark task)."""

    root: str
    storage_options: dict[str, Any]
    dest: str
    dest_storage_options: dict[str, Any]
    checkpoint_id: int
    savepoint_id: int
    old_max_parallelism: int
    new_max_parallelism: int
    unpickle: bool = False
    decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS

    @property
    def rekey(self) -> bool:
        return self.old_max_parallelism != self.new_max_parallelism


@dataclass
class RewriteJob:
    """A planned rewrite (driver side): the stores, the source manifest, the tasks."""

    kind: str  # "compact" | "rekey"
    context: RewriteContext
    source: SnapshotStore
    dest: SnapshotStore
    manifest: Manifest
    job: dict[str, Any]
    tasks: list[KeyGroupTask]
    started: float = field(default_factory=time.monotonic)

    @property
    def states(self) -> list[tuple[str, str]]:
        """Every keyed (operator, state) of the source checkpoint, sorted."""
        return sorted((op, st) for op, states in self.manifest.keyed.items() for st in states)


def check_new_max_parallelism(value: Any) -> int:
    """``value`` if it is an integer in ``[1, 32768]``, else :class:`MaxParallelismError`."""
    if type(value) is not int or not 1 <= value <= MAX_MAX_PARALLELISM:
        raise MaxParallelismError(
            f"new max_parallelism {value!r} is invalid; use an integer between 1 and {MAX_MAX_PARALLELISM} "
            "(the number of key groups the restored job declares with Dataflow(..., max_parallelism=N))"
        )
    return value


def _normalize_url(url: str) -> str:
    """Local paths become absolute (Spark executors may run in another working directory)."""
    if not isinstance(url, str) or not url:
        raise RewriteInputError(f"{url!r} is not a path or URL; pass e.g. /data/ckpt or s3://bucket/prefix")
    protocol, path = fsspec.core.split_protocol(url)
    if protocol is None:
        return os.path.abspath(path)
    return url


def _require_executor_reachable(store: SnapshotStore, what: str) -> None:
    if "memory" in protocols_of(store.fs):
        raise ExecutorStorageError(
            f"{what} {store.url} is a memory:// root, which exists only inside this process; Spark executors "
            "cannot read or write it; use a path or URL every executor can open (local disk with local[*], "
            "s3://...), or run without --spark (in-process)"
        )


def _open_source(root: str, options: Mapping[str, Any], *, for_spark: bool,
                 decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS) -> SnapshotStore:
    source = SnapshotStore.open(root, options, decode_limits=decode_limits)
    if for_spark:
        _require_executor_reachable(source, "ROOT")
    if not source.exists():
        raise RewriteInputError(f"{root}: holds no snapshots (no _job.json, no manifests); check the path or URL "
                                "(and the storage options)")
    return source


def _open_empty_dest(dest: str, options: Mapping[str, Any], root: str, *, for_spark: bool) -> SnapshotStore:
    if dest.rstrip("/") == root.rstrip("/"):
        raise DestinationNotEmptyError(
            f"{dest}: the destination is the source root; a rewrite writes a new, self-contained root; "
            "pass an empty directory or prefix as DEST"
        )
    store = SnapshotStore.open(dest, options)
    if for_spark:
        _require_executor_reachable(store, "DEST")
    files = store.list_files()
    if not files:
        return store
    if store.exists():
        job = store.read_job() or {}
        raise DestinationNotEmptyError(
            f"{dest}: is already a snapshot root (job {job.get('job_name')!r}, max_parallelism "
            f"{job.get('max_parallelism')}, checkpoints {store.list_checkpoints()[-5:]}); refusing to write into it; "
            "pass a new, empty directory or prefix as DEST (to add a savepoint to an existing root of the same job, "
            "use 'abs-snapshot savepoint' without --spark)"
        )
    sample = sorted(files)[:3]
    raise DestinationNotEmptyError(
        f"{dest}: is not empty ({len(files)} file(s), e.g. {sample}); refusing to mix a savepoint with other files "
        "(a rewrite interrupted before its manifest also leaves files); delete them or pass a new, empty "
        "directory or prefix as DEST"
    )


def plan_rewrite(
    root: str,
    checkpoint_id: int,
    dest: str,
    *,
    max_parallelism: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    for_spark: bool = True,
    unpickle: bool = False,
    decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS,
) -> RewriteJob:
    """Check the inputs and plan a rewrite (no state file is decoded; a re-key without
    ``unpickle`` reads the schema of one file per state).

    ``max_parallelism=None`` plans a compaction, an integer a re-key into that many key groups.
    ``unpickle``: a re-key may unpickle pickled keys to hash them (runs code from the
    snapshot); without it a state with pickled keys raises :class:`UnpickleRefusedError`
    (here when the first file of a state has them, else in the task that meets them).
    Compaction copies pickled bytes as they are and never needs it. ``decode_limits``: how far
    one state file may expand when read (:class:`storage.format.DecodeLimits`).
    ``dest_storage_options=None``: a destination of the same protocol as ``root`` uses
    ``storage_options``. ``for_spark`` refuses roots the executors cannot reach.
    """
    if type(checkpoint_id) is not int or checkpoint_id < 1:
        raise RewriteInputError(f"checkpoint id {checkpoint_id!r} is invalid; pass the id of a complete checkpoint "
                                "('abs-snapshot ls ROOT' lists them)")
    if max_parallelism is not None:
        check_new_max_parallelism(max_parallelism)
    root, dest = _normalize_url(root), _normalize_url(dest)
    options = dict(storage_options or {})
    if dest_storage_options is None:
        same = fsspec.core.split_protocol(root)[0] == fsspec.core.split_protocol(dest)[0]
        dest_options = dict(options) if same else {}
    else:
        dest_options = dict(dest_storage_options)
    source = _open_source(root, options, for_spark=for_spark, decode_limits=decode_limits)
    manifest = source.read_manifest(checkpoint_id)  # CheckpointNotFoundError names the complete ones
    problems = manifest_problems(manifest)
    if problems:
        path, message = problems[0]
        raise CorruptManifestError(
            f"{root}: checkpoint {checkpoint_id}: {path + ': ' if path else ''}{message} ({len(problems)} problem(s)); "
            "the manifest is corrupt; refusing to rewrite it; pick another checkpoint ('abs-snapshot verify ROOT')"
        )
    target = _open_empty_dest(dest, dest_options, root, for_spark=for_spark)
    old = manifest.max_parallelism
    new = old if max_parallelism is None else max_parallelism
    context = RewriteContext(root=root, storage_options=options, dest=dest, dest_storage_options=dest_options,
                             checkpoint_id=checkpoint_id, savepoint_id=checkpoint_id,
                             old_max_parallelism=old, new_max_parallelism=new, unpickle=unpickle,
                             decode_limits=decode_limits)
    job = source.read_job() or {"job_name": manifest.job_name, "max_parallelism": old}
    tasks = [KeyGroupTask(op, st, kg, tuple(chain))
             for op, states in sorted(manifest.keyed.items()) for st, chains in sorted(states.items())
             for kg, chain in sorted(chains.items())]
    if max_parallelism is not None and not unpickle:
        _refuse_pickled_keys(source, context, tasks)
    return RewriteJob(kind="compact" if max_parallelism is None else "rekey", context=context, source=source,
                      dest=target, manifest=manifest, job=dict(job), tasks=tasks)


def _pickled_keys_refusal(ctx: RewriteContext, operator: str, state: str) -> UnpickleRefusedError:
    return UnpickleRefusedError(
        f"checkpoint {ctx.checkpoint_id}: operator {operator!r} state {state!r} has pickled keys; re-keying must "
        "unpickle them, which runs code from the snapshot; pass --unpickle (unpickle=True) if you trust this root"
    )


def _refuse_pickled_keys(source: SnapshotStore, ctx: RewriteContext, tasks: Sequence[KeyGroupTask]) -> None:
    """Refuse early when the base of a state's first key group has pickled keys (the tasks
    check every key group again before hashing)."""
    first: dict[tuple[str, str], KeyGroupTask] = {}
    for task in tasks:
        first.setdefault((task.operator, task.state), task)
    for (operator, state), task in first.items():
        if is_pickled(source.read_schema(task.chain[0]), KEY_COLUMN):
            raise _pickled_keys_refusal(ctx, operator, state)


def group_tasks(tasks: Sequence[KeyGroupTask], key_groups_per_task: int | None = None) -> list[list[KeyGroupTask]]:
    """Runs of consecutive key groups, one per Spark task: ``key_groups_per_task`` each, or
    (``None``) packed by file bytes like the ``abs-snapshot`` data source does
    (:func:`storage.spark.auto_partition_count`: ~32 MiB per task, at most 256 tasks)."""
    if key_groups_per_task is not None:
        if type(key_groups_per_task) is not int or key_groups_per_task < 1:
            raise RewriteInputError(f"key_groups_per_task={key_groups_per_task!r}; use an integer >= 1 or None (auto)")
        return [list(tasks[i:i + key_groups_per_task]) for i in range(0, len(tasks), key_groups_per_task)]
    from storage.spark import _pack_by_bytes  # packs (item, chain) pairs; imports no pyspark

    packed = _pack_by_bytes([(task, list(task.chain)) for task in tasks])
    return [[task for task, _ in group] for group in packed]


# ============================================================================ task side
def _source_store(ctx: RewriteContext) -> SnapshotStore:
    from storage.spark import _open_store  # one cached store per Python worker (read only)

    store = _open_store(ctx.root, ctx.storage_options, cached=True)
    if store.decode_limits != ctx.decode_limits:  # the cached store's file system, this rewrite's limits
        store = SnapshotStore(store._io, policy=store.policy, decode_limits=ctx.decode_limits)
    return store


def _dest_store(ctx: RewriteContext) -> SnapshotStore:
    # opened per task, not cached: a cached store remembers the directories it created
    return SnapshotStore.open(ctx.dest, ctx.dest_storage_options, check=False)


def _write_base(dest: SnapshotStore, ctx: RewriteContext, operator: str, state: str, key_group: int,
                table: pa.Table) -> FileRef:
    sp = ctx.savepoint_id
    return dest._write_table(StoragePaths.state_file(sp, operator, state, key_group, "base"), table, "base", sp)


def compact_group(ctx: RewriteContext, group: Iterable[KeyGroupTask]) -> Iterator[tuple[str, str, int, FileRef]]:
    """Resolve each chain of ``group`` and write it as one base of the savepoint (a key group
    whose keys were all deleted gets an empty base, as in :func:`take_savepoint`)."""
    source, dest = _source_store(ctx), _dest_store(ctx)
    for task in group:
        table = source.read_chain(list(task.chain), checkpoint_id=ctx.checkpoint_id)
        yield task.operator, task.state, task.key_group, _write_base(dest, ctx, task.operator, task.state,
                                                                     task.key_group, table)


def _where(ctx: RewriteContext, operator: str, state: str, key_group: int) -> str:
    return f"{ctx.root}: checkpoint {ctx.checkpoint_id}: {operator}/{state} key group {key_group}"


def _python_keys(table: pa.Table, where: str) -> list[Any]:
    """Unpickle a pickled key column (only ever inside a task)."""
    try:
        return [pickle.loads(b) for b in table.column(KEY_COLUMN).to_pylist()]
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing
        raise RewriteError(
            f"{where}: a pickled key does not unpickle here ({type(exc).__name__}: {exc}); re-key where the "
            "classes of the keys can be imported (same code and Python as the job)"
        ) from exc


def _hashes(table: pa.Table, where: str, *, unpickle: bool = False) -> "NDArray[np.uint64]":
    """The runtime's stable hash of every key: vectorized for typed keys, per unpickled key
    for pickled ones (only with ``unpickle``; :class:`UnpickleRefusedError` without)."""
    pickled = is_pickled(table.schema, KEY_COLUMN)
    if pickled and not unpickle:
        raise UnpickleRefusedError(
            f"{where}: the keys are pickled; re-keying must unpickle them, which runs code from the snapshot; "
            "pass --unpickle (unpickle=True) if you trust this root"
        )
    keys: Any = _python_keys(table, where) if pickled else table.column(KEY_COLUMN)
    try:
        return stable_hashes(keys)
    except (TypeError, ValueError) as exc:
        raise RewriteError(f"{where}: the keys cannot be hashed ({exc}); they were not written by the runtime") from exc


def _check_placement(hashes: "NDArray[np.uint64]", table: pa.Table, ctx: RewriteContext, task: KeyGroupTask) -> None:
    old = hashes % np.uint64(ctx.old_max_parallelism)
    wrong = np.flatnonzero(old != np.uint64(task.key_group))
    if wrong.size:
        key = table.column(KEY_COLUMN)[int(wrong[0])].as_py()
        if is_pickled(table.schema, KEY_COLUMN):
            key = pickle.loads(key)
        raise RewriteError(
            f"{_where(ctx, task.operator, task.state, task.key_group)}: {wrong.size} key(s) do not belong there, "
            f"e.g. key {key!r} hashes to key group {int(old[wrong[0]])} of max_parallelism {ctx.old_max_parallelism}; "
            "the snapshot is corrupt or was written with another key hash; refusing to re-key it"
        )


def _split_by(table: pa.Table, groups: "NDArray[np.int64]") -> Iterator[tuple[int, pa.Table]]:
    """``(group, rows of that group)`` for every distinct value of ``groups`` (one row each)."""
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    ends = np.append(starts[1:], len(ordered))
    taken = table.take(pa.array(order))
    for start, end in zip(starts.tolist(), ends.tolist()):
        yield int(ordered[start]), taken.slice(start, end - start)


def to_ipc(table: pa.Table) -> bytes:
    """An Arrow IPC stream (lz4 buffers): how rows travel through a Spark shuffle."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_SHUFFLE_WRITE) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.BufferReader(data)).read_all()


def split_group(ctx: RewriteContext, group: Iterable[KeyGroupTask]) -> Iterator[tuple[tuple[str, str, int], pa.Table]]:
    """Re-key stage 1: resolve each chain (deletes applied), check that every key belongs to
    its old key group, hash it into the new key groups and yield ``((operator, state, new key
    group), those rows)``."""
    source = _source_store(ctx)
    for task in group:
        table = source.read_chain(list(task.chain), checkpoint_id=ctx.checkpoint_id)
        if table.num_rows == 0:
            continue
        if not ctx.unpickle and is_pickled(table.schema, KEY_COLUMN):
            raise _pickled_keys_refusal(ctx, task.operator, task.state)
        hashes = _hashes(table, _where(ctx, task.operator, task.state, task.key_group), unpickle=ctx.unpickle)
        _check_placement(hashes, table, ctx, task)
        new = (hashes % np.uint64(ctx.new_max_parallelism)).astype(np.int64)
        for kg, part in _split_by(table, new):
            yield (task.operator, task.state, kg), part


def _pickle_keys(table: pa.Table) -> pa.Table:
    if is_pickled(table.schema, KEY_COLUMN):
        return table
    blobs = [pickle.dumps(k, _KEY_PICKLE_PROTOCOL) for k in table.column(KEY_COLUMN).to_pylist()]
    meta = dict(table.schema.metadata or {})
    meta[META_KEY_ENCODING] = ENCODING_PICKLE
    index = table.schema.get_field_index(KEY_COLUMN)
    out = table.set_column(index, pa.field(KEY_COLUMN, pa.binary(), nullable=False), pa.array(blobs, pa.binary()))
    return out.replace_schema_metadata(meta)


def _merge_parts(parts: list[pa.Table], where: str) -> pa.Table:
    """Rows of one new key group from several old ones. Key groups whose keys were stored with
    different Arrow types (or some pickled) are merged with pickled keys, exactly as the
    runtime encodes a key group holding keys of several types."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0].schema
    if all(p.schema.equals(first, check_metadata=True) for p in parts[1:]):
        return pa.concat_tables(parts)
    value_encodings = {(p.schema.metadata or {}).get(META_VALUE_ENCODING, ENCODING_ARROW) for p in parts}
    if len(value_encodings) > 1:
        raise RewriteError(f"{where}: the old key groups store the values with different encodings "
                           f"({sorted(e.decode() for e in value_encodings)}); cannot merge them into one key group")
    key_types = {p.schema.field(KEY_COLUMN).type for p in parts}
    if len(key_types) > 1 or any(is_pickled(p.schema, KEY_COLUMN) for p in parts):
        parts = [_pickle_keys(p) for p in parts]
    meta = parts[0].schema.metadata
    parts = [p.replace_schema_metadata(meta) for p in parts]
    try:
        return pa.concat_tables(parts, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise RewriteError(f"{where}: the old key groups have incompatible schemas ({exc}); "
                           "cannot merge them into one key group") from exc


def write_rekeyed(ctx: RewriteContext, target: tuple[str, str, int], parts: Iterable[pa.Table]
                  ) -> tuple[str, str, int, FileRef]:
    """Re-key stage 2: merge the rows of one new key group (from any old ones) and write its base."""
    operator, state, kg = target
    where = f"{ctx.dest}: savepoint {ctx.savepoint_id}: {operator}/{state} new key group {kg}"
    table = _merge_parts(list(parts), where)
    if pc.count_distinct(table.column(KEY_COLUMN)).as_py() != table.num_rows:
        raise RewriteError(f"{where}: a key occurs in two old key groups; the source snapshot is corrupt; "
                           "refusing to write the savepoint")
    return operator, state, kg, _write_base(_dest_store(ctx), ctx, operator, state, kg, table)


# ============================================================================ driver side
def _keyed(job: RewriteJob, refs: Iterable[tuple[str, str, int, FileRef]]) -> dict[str, dict[str, dict[int, list[FileRef]]]]:
    keyed: dict[str, dict[str, dict[int, list[FileRef]]]] = {}
    for op, st in job.states:
        keyed.setdefault(op, {})[st] = {}
    for op, st, kg, ref in refs:
        chains = keyed[op][st]
        if kg in chains:
            raise RewriteError(f"{job.context.dest}: {op}/{st} key group {kg} was written twice; "
                               "nothing was committed; run the rewrite again into an empty destination")
        chains[kg] = [ref]
    return {op: {st: dict(sorted(chains.items())) for st, chains in states.items()} for op, states in keyed.items()}


def finish(job: RewriteJob, refs: Iterable[tuple[str, str, int, FileRef]], *, engine: str, tasks: int) -> Manifest:
    """Commit the savepoint: operator state and channel logs copied, ``_job.json`` written,
    then the manifest (the commit point). Returns the committed manifest."""
    ctx = job.context
    keyed = _keyed(job, refs)
    operator_state, channel_logs = copy_unkeyed(job.source, job.manifest, job.dest, job.context.savepoint_id)
    fingerprint = dict(job.job, max_parallelism=ctx.new_max_parallelism)
    rewrite: dict[str, Any] = {"kind": job.kind, "engine": engine, "tasks": tasks,
                               "seconds": round(time.monotonic() - job.started, 3)}
    if job.kind == "rekey":
        origin = {"root": ctx.root, "checkpoint_id": ctx.checkpoint_id, "max_parallelism": ctx.old_max_parallelism}
        fingerprint["rekeyed_from"] = origin
        rewrite.update(max_parallelism_from=ctx.old_max_parallelism, max_parallelism_to=ctx.new_max_parallelism)
    savepoint = dataclasses.replace(
        job.manifest,
        checkpoint_id=ctx.savepoint_id,
        kind="savepoint",
        max_parallelism=ctx.new_max_parallelism,
        created_at=job.dest._now(),
        keyed=keyed,
        operator_state=operator_state,
        channel_logs=channel_logs,
        stats={"savepoint_of": {"root": job.source.url, "checkpoint_id": ctx.checkpoint_id,
                                "stats": job.manifest.stats}, "rewrite": rewrite},
        lineage=None,  # a savepoint follows no checkpoint of its root
    )
    job.dest.init_job(fingerprint)
    return job.dest.commit(savepoint)


def rekey_local(
    root: str,
    checkpoint_id: int,
    dest: str,
    *,
    max_parallelism: int,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    unpickle: bool = False,
    decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS,
) -> Manifest:
    """The re-key in this process, without Spark (all live rows are held in memory at once, as
    Arrow tables; use :func:`recovery.spark.rekey` for states larger than memory). Works on
    ``memory://`` roots too. Returns the committed savepoint manifest. ``unpickle``: allow
    unpickling pickled keys to hash them (runs code from the snapshot; see
    :class:`UnpickleRefusedError`)."""
    job = plan_rewrite(root, checkpoint_id, dest, max_parallelism=max_parallelism, storage_options=storage_options,
                       dest_storage_options=dest_storage_options, for_spark=False, unpickle=unpickle,
                       decode_limits=decode_limits)
    buckets: dict[tuple[str, str, int], list[pa.Table]] = {}
    for target, part in split_group(job.context, job.tasks):
        buckets.setdefault(target, []).append(part)
    refs = [write_rekeyed(job.context, target, buckets.pop(target)) for target in sorted(buckets)]
    return finish(job, refs, engine="local", tasks=1)
