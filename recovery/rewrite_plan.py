"""Planning an offline rewrite (compact / re-key), on the driver: check the inputs, open the
source root and the empty destination, and list the key groups to rewrite as tasks
(:class:`RewriteJob`), grouped into runs for the engine (:func:`group_tasks`). No state file
is decoded here."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import fsspec.core

from abscore.keygroups import MAX_MAX_PARALLELISM
from abscore.schema import KEY_COLUMN
from storage import FileRef, Manifest, SnapshotStore
from storage.backend import protocols_of
from storage.errors import CorruptManifestError
from storage.format import DEFAULT_DECODE_LIMITS, DecodeLimits, is_pickled
from storage.manifest import manifest_problems
from storage.savepoint import savepoint_packs

from .errors import (
    DestinationNotEmptyError,
    ExecutorStorageError,
    MaxParallelismError,
    RewriteInputError,
    UnpickleRefusedError,
)

__all__ = [
    "KeyGroupTask",
    "RewriteContext",
    "RewriteJob",
    "check_new_max_parallelism",
    "plan_rewrite",
    "group_tasks",
    "group_packs",
]


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
    from storage.spark_partitions import _pack_by_bytes  # packs (item, chain) pairs; imports no pyspark

    packed = _pack_by_bytes([(task, list(task.chain)) for task in tasks])
    return [[task for task, _ in group] for group in packed]


def group_packs(tasks: Sequence[KeyGroupTask], key_groups_per_task: int | None = None) -> list[list[list[KeyGroupTask]]]:
    """The compact's Spark tasks: runs of whole savepoint packs (:func:`storage.savepoint.savepoint_packs`,
    the runs of key groups the in-process savepoint writes together), so that each pack is
    written by one task exactly as :func:`storage.savepoint.take_savepoint` writes it (the same
    bytes per key group). ``key_groups_per_task``: packs are joined while the task holds at most
    that many key groups (a larger pack is a task of its own); ``None``: packed by file bytes as
    :func:`group_tasks` packs key groups."""
    packs = [[KeyGroupTask(*item) for item in pack]
             for pack in savepoint_packs([(t.operator, t.state, t.key_group, t.chain) for t in tasks])]
    if key_groups_per_task is not None:
        if type(key_groups_per_task) is not int or key_groups_per_task < 1:
            raise RewriteInputError(f"key_groups_per_task={key_groups_per_task!r}; use an integer >= 1 or None (auto)")
        groups: list[list[list[KeyGroupTask]]] = []
        count = 0
        for pack in packs:
            if not groups or count + len(pack) > key_groups_per_task:
                groups.append([])
                count = 0
            groups[-1].append(pack)
            count += len(pack)
        return groups
    from storage.spark_partitions import _pack_by_bytes

    packed = _pack_by_bytes([(pack, [ref for task in pack for ref in task.chain]) for pack in packs])
    return [[pack for pack, _ in group] for group in packed]
