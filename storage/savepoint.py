"""Savepoints: self-contained, pinned copies of a checkpoint.

Every key group's chain is compacted into one base; operator-state and channel files are
copied byte for byte (checksums verified on the way). The savepoint gets the id
``max(checkpoint_id, next id of the destination)`` so that a savepoint into the same root
takes a fresh id and a savepoint into an empty root keeps the source id (a job restored from
it continues numbering above it). Its manifest has ``kind = "savepoint"``, which pins it:
GC keeps it and its files regardless of retention until
:meth:`SnapshotStore.delete_savepoint` unpins it.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .ids import CheckpointId
from .manifest import FileRef, Manifest
from .paths import StoragePaths

if TYPE_CHECKING:
    from .store import SnapshotStore

__all__ = ["take_savepoint", "copy_unkeyed"]


def take_savepoint(source: "SnapshotStore", checkpoint_id: int, dest: "SnapshotStore") -> Manifest:
    """Copy checkpoint ``checkpoint_id`` of ``source`` into ``dest`` as a savepoint; returns
    the committed savepoint manifest."""
    manifest = source.read_manifest(checkpoint_id)
    job = source.read_job() or {"job_name": manifest.job_name, "max_parallelism": manifest.max_parallelism}
    dest.init_job(job)
    sp_id = CheckpointId(max(checkpoint_id, dest.next_checkpoint_id()))

    keyed: dict[str, dict[str, dict[int, list[FileRef]]]] = {}
    for op, states in manifest.keyed.items():
        for st, chains in states.items():
            out = keyed.setdefault(op, {}).setdefault(st, {})
            for kg, chain in sorted(chains.items()):
                table = source.read_chain(chain, checkpoint_id=checkpoint_id)
                path = StoragePaths.state_file(sp_id, op, st, kg, "base")
                out[kg] = [dest._write_table(path, table, "base", sp_id)]

    operator_state, channel_logs = copy_unkeyed(source, manifest, dest, sp_id)

    savepoint = dataclasses.replace(
        manifest,
        checkpoint_id=sp_id,
        kind="savepoint",
        created_at=dest._now(),
        keyed=keyed,
        operator_state=operator_state,
        channel_logs=channel_logs,
        stats={"savepoint_of": {"root": source.url, "checkpoint_id": checkpoint_id, "stats": manifest.stats}},
    )
    return dest.commit(savepoint)


def copy_unkeyed(source: "SnapshotStore", manifest: Manifest, dest: "SnapshotStore",
                 savepoint_id: int) -> tuple[dict[str, dict[int, FileRef]], list[FileRef]]:
    """Copy the operator-state and channel-log files of ``manifest`` (a checkpoint of
    ``source``) into ``dest`` under ``savepoint_id``, byte for byte (checksums verified on
    the way); returns the new references (also used by the offline rewrites in ``recovery``)."""
    cid = manifest.checkpoint_id
    operator_state: dict[str, dict[int, FileRef]] = {}
    for op, subtasks in sorted(manifest.operator_state.items()):
        for i, ref in sorted(subtasks.items()):
            data = source.read_bytes(ref, checkpoint_id=cid)
            path = StoragePaths.opstate_file(savepoint_id, op, i)
            operator_state.setdefault(op, {})[i] = dest._copy_in(data, ref, path, savepoint_id)
    channel_logs = []
    for ref in manifest.channel_logs:
        task = ref.location().task
        assert task is not None
        data = source.read_bytes(ref, checkpoint_id=cid)
        channel_logs.append(dest._copy_in(data, ref, StoragePaths.channel_file(savepoint_id, task), savepoint_id))
    return operator_state, channel_logs
