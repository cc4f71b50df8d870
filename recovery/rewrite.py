"""Offline rewrites of a checkpoint into a self-contained savepoint in an empty root: the
engine-independent core of :mod:`recovery.spark` (planning, the work of one task, the commit)
and an in-process re-key (:func:`rekey_local`) for states that fit in one process.

Two rewrites share this code:

- **compact**: every key group's chain (base + deltas) is resolved into one base in the same
  key group, packed in the runs :func:`storage.savepoint.take_savepoint` packs; the result
  equals that savepoint (same bytes per base; an empty base for a key group without live rows).
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

This module commits a rewrite (:func:`finish`) and runs the in-process re-key; the planning
(:mod:`recovery.rewrite_plan`), the work of the tasks (:mod:`recovery.rewrite_tasks`) and
the errors (:mod:`recovery.errors`) live next door and are handed on from here.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Iterator, Mapping

import pyarrow as pa

from abscore.keygroups import MAX_MAX_PARALLELISM, stable_hashes
from abscore.progress import ProgressCallback, Tracker
from storage import FileRef, Manifest
from storage.format import DEFAULT_DECODE_LIMITS, DecodeLimits
from storage.savepoint import copy_unkeyed

from .errors import (
    DestinationNotEmptyError,
    ExecutorStorageError,
    MaxParallelismError,
    RewriteError,
    RewriteInputError,
    SparkNotInstalledError,
    UnpickleRefusedError,
)
from .rewrite_plan import (KeyGroupTask, RewriteContext, RewriteJob, check_new_max_parallelism, group_packs, group_tasks,
                           plan_rewrite)
from .rewrite_tasks import compact_group, from_ipc, split_group, to_ipc, write_rekeyed

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
    "group_packs",
    "compact_group",
    "split_group",
    "write_rekeyed",
    "to_ipc",
    "from_ipc",
    "finish",
    "rekey_local",
]

# the re-key's key hash (abscore.keygroups.stable_hashes) has always been importable from here
_HANDED_ON = (stable_hashes,)


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
    progress: ProgressCallback | None = None,
) -> Manifest:
    """The re-key in this process, without Spark (all live rows are held in memory at once, as
    Arrow tables; use :func:`recovery.spark.rekey` for states larger than memory). Works on
    ``memory://`` roots too. Returns the committed savepoint manifest. ``unpickle``: allow
    unpickling pickled keys to hash them (runs code from the snapshot; see
    :class:`UnpickleRefusedError`). ``progress`` hears of each old key group read (stage
    ``rekey: read``) and each new one written (``rekey: write``)."""
    job = plan_rewrite(root, checkpoint_id, dest, max_parallelism=max_parallelism, storage_options=storage_options,
                       dest_storage_options=dest_storage_options, for_spark=False, unpickle=unpickle,
                       decode_limits=decode_limits)
    buckets: dict[tuple[str, str, int], list[pa.Table]] = {}
    read = Tracker(progress, "rekey: read", len(job.tasks), "key groups")

    def counted(tasks: Iterable[KeyGroupTask]) -> Iterator[KeyGroupTask]:
        for task in tasks:
            yield task
            read.advance()  # split_group asks for the next task once it has split this one

    for target, part in split_group(job.context, counted(job.tasks)):
        buckets.setdefault(target, []).append(part)
    written = Tracker(progress, "rekey: write", len(buckets), "key groups")
    refs = []
    for target in sorted(buckets):
        refs.append(write_rekeyed(job.context, target, buckets.pop(target)))
        written.advance()
    return finish(job, refs, engine="local", tasks=1)
