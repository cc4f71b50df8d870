"""Savepoints: self-contained, pinned copies of a checkpoint.

Every key group's chain is compacted into one base, written packed as a checkpoint writes its
key groups (:func:`savepoint_packs`: a packed file per run of a state's key groups, small key
groups sharing a stream; a key group whose keys were all deleted keeps an empty base); operator-state and channel files are
copied byte for byte (checksums verified on the way). The savepoint gets the id
``max(checkpoint_id, next id of the destination)`` so that a savepoint into the same root
takes a fresh id and a savepoint into an empty root keeps the source id (a job restored from
it continues numbering above it). Its manifest has ``kind = "savepoint"``, which pins it:
GC keeps it and its files regardless of retention until
:meth:`SnapshotStore.delete_savepoint` unpins it.

While it copies, a savepoint holds two pins (``storage/pins.py``): one in the source root on
the checkpoint it copies, so that no GC (the running job's, or another process's) deletes
its files, and one in the destination on the savepoint's own id. The destination gets a
marker ``checkpoints/.sp-<id>.incomplete`` first and the manifest last: a copy that fails is
removed again, and one that was killed leaves the marker and no manifest (never something
that reads as a savepoint); the next savepoint into that destination removes what it left.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence

import pyarrow as pa

from abscore.progress import ProgressCallback, Tracker

from .backend import RootIO
from .errors import (CheckpointExistsError, CheckpointNotFoundError, MissingFileError, StorageError,
                     StorageUnavailableError)
from .ids import CheckpointId
from .manifest import FileRef, Manifest
from .paths import FileKind, StoragePaths
from .pins import PinLease, PinRecord
from .store_write import KeyGroupWrite

__all__ = ["SavepointStore", "take_savepoint", "copy_unkeyed", "remove_incomplete_savepoints", "savepoint_packs",
           "write_savepoint_pack", "SAVEPOINT_PACK_BYTES"]

SAVEPOINT_PACK_BYTES = 8 << 20
"""A savepoint writes the key groups of one (operator, state) in runs of consecutive key groups
whose source chains hold up to this many bytes (:func:`savepoint_packs`), each run packed as a
checkpoint packs its key groups (:meth:`SnapshotStore.write_key_groups`). The runs depend on the
source manifest only, so the offline rewrite (``recovery.spark.compact``), whose Spark tasks
each write whole runs, writes the same bytes per key group as the in-process savepoint; the
bound keeps a large state spread over several Spark tasks."""

KeyGroupChain = tuple[str, str, int, Sequence[FileRef]]
"""(operator, state, key group, chain) of a checkpoint."""


class SavepointStore(Protocol):
    """What a savepoint uses of a :class:`storage.SnapshotStore` (named by this protocol, so
    that this module does not import :mod:`storage.store`, which calls it): the public reads,
    pins and commit, and the store's internal hooks for savepoints (``_io``, ``_write_table``,
    ``_copy_in``, ``_now``)."""

    _io: RootIO

    @property
    def url(self) -> str: ...

    def list_files(self) -> dict[str, int]: ...

    def init_job(self, fingerprint: Mapping[str, Any]) -> None: ...

    def read_job(self) -> dict[str, Any] | None: ...

    def next_checkpoint_id(self) -> CheckpointId: ...

    def read_manifest(self, checkpoint_id: int) -> Manifest: ...

    def read_chain(self, chain: Sequence[FileRef], *, checkpoint_id: int | None = None) -> pa.Table: ...

    def read_bytes(self, ref: FileRef, *, checkpoint_id: int | None = None) -> bytes: ...

    def commit(self, manifest: Manifest) -> Manifest: ...

    def write_key_groups(self, checkpoint_id: int, jobs: Sequence[Any]) -> list[list[FileRef]]: ...

    def pins(self) -> list[PinRecord]: ...

    def pin(self, first: int, last: int | None = None, *, ttl: float = ..., holder: str = "") -> PinLease: ...

    def _write_table(self, path: str, table: pa.Table, kind: FileKind, checkpoint_id: int) -> FileRef: ...

    def _copy_in(self, data: bytes, ref: FileRef, path: str, checkpoint_id: int) -> FileRef: ...

    def _now(self) -> float: ...

_DATA = ("base", "delta", "packed", "opstate", "channel")


def take_savepoint(source: SavepointStore, checkpoint_id: int, dest: SavepointStore, *,
                   source_pin: PinLease | None = None, progress: ProgressCallback | None = None) -> Manifest:
    """Copy checkpoint ``checkpoint_id`` of ``source`` into ``dest`` as a savepoint; returns
    the committed savepoint manifest.

    ``source_pin``: a lease the caller already holds on the checkpoint (it is renewed here,
    and stays the caller's to release); without it the checkpoint is pinned here for the
    copy. A checkpoint that GC removed before the pin took effect raises
    :class:`CheckpointNotFoundError` (or :class:`MissingFileError`) and leaves nothing in ``dest``.
    ``progress`` hears of each key group copied (stage ``savepoint: copy``).
    """
    own = source_pin is None
    lease = source_pin
    if own:
        try:
            lease = source.pin(checkpoint_id, checkpoint_id, holder=f"savepoint of checkpoint {checkpoint_id}")
        except StorageUnavailableError as exc:  # e.g. read-only credentials for the source
            warnings.warn(f"{source.url}: cannot pin checkpoint {checkpoint_id} while copying it ({exc}); copying it "
                          "unpinned: a GC running on that root may remove it meanwhile (the savepoint then fails and "
                          "leaves nothing)", RuntimeWarning, stacklevel=3)
    try:
        manifest = source.read_manifest(checkpoint_id)
        try:
            return _copy(source, manifest, dest, lease, progress)
        except MissingFileError as exc:
            if StoragePaths.manifest(checkpoint_id) in source.list_files():
                raise
            raise CheckpointNotFoundError(
                f"{source.url}: checkpoint {checkpoint_id} was removed by garbage collection while the savepoint "
                f"copied it (a GC planned before the savepoint's pin took effect: {exc}); nothing was left in "
                f"{dest.url}; take the savepoint again from a newer checkpoint"
            ) from exc
    finally:
        if own and lease is not None:
            lease.release()


def _copy(source: SavepointStore, manifest: Manifest, dest: SavepointStore, lease: PinLease | None,
          progress: ProgressCallback | None = None) -> Manifest:
    checkpoint_id = manifest.checkpoint_id
    job = source.read_job() or {"job_name": manifest.job_name, "max_parallelism": manifest.max_parallelism}
    dest.init_job(job)
    remove_incomplete_savepoints(dest)
    sp_id = CheckpointId(max(checkpoint_id, dest.next_checkpoint_id()))
    marker = StoragePaths.savepoint_incomplete(sp_id)
    written: list[str] = []
    with dest.pin(sp_id, sp_id, holder=f"savepoint {sp_id} being written") as dest_lease:
        dest._io.put(marker, f"savepoint {sp_id} of {source.url} checkpoint {checkpoint_id}: copy in progress\n".encode())
        try:
            keyed: dict[str, dict[str, dict[int, list[FileRef]]]] = {}
            tracker = Tracker(progress, "savepoint: copy", sum(len(c) for s in manifest.keyed.values() for c in s.values()),
                              "key groups")
            for op, states in manifest.keyed.items():
                for st in states:
                    keyed.setdefault(op, {}).setdefault(st, {})

            def renewed() -> None:
                if lease is not None:
                    lease.renew()
                dest_lease.renew()

            for pack in savepoint_packs(manifest):
                for op, st, kg, chain in write_savepoint_pack(source, checkpoint_id, dest, sp_id, pack, renewed,
                                                              tracker.advance):
                    written.extend(ref.path for ref in chain)
                    keyed[op][st][kg] = chain

            if lease is not None:
                lease.renew()
            operator_state, channel_logs = copy_unkeyed(source, manifest, dest, sp_id)
            written.extend(ref.path for refs in operator_state.values() for ref in refs.values())
            written.extend(ref.path for ref in channel_logs)

            savepoint = dataclasses.replace(
                manifest,
                checkpoint_id=sp_id,
                kind="savepoint",
                created_at=dest._now(),
                keyed=keyed,
                operator_state=operator_state,
                channel_logs=channel_logs,
                stats={"savepoint_of": {"root": source.url, "checkpoint_id": checkpoint_id, "stats": manifest.stats}},
                lineage=None,  # a savepoint follows no checkpoint of its root
            )
            try:
                stored = dest.commit(savepoint)
            except CheckpointExistsError as exc:
                raise CheckpointExistsError(
                    f"{dest.url}: savepoint {sp_id} of checkpoint {checkpoint_id} was not written: checkpoint {sp_id} "
                    "already has a manifest: a job writing this root committed it while the savepoint copied (a "
                    "savepoint takes the root's next free id, which the job's next checkpoint takes too); nothing of "
                    "the savepoint was left; take the savepoint into a directory of its own (e.g. ROOT/savepoints/"
                    "NAME), or take it again"
                ) from exc
        except BaseException:
            # files whose names the failed step did not return are found by their id, unless
            # another savepoint committed that id meanwhile (one copy at a time into a root)
            committed = StoragePaths.manifest(sp_id) in dest.list_files()
            _remove(dest, [*written, *([] if committed else _files_of(dest, sp_id)), marker])
            raise
        dest._io.delete(marker)
    return stored


def savepoint_packs(chains: Manifest | Iterable[KeyGroupChain], limit: int | None = None) -> list[list[KeyGroupChain]]:
    """The runs of key groups a savepoint writes together (``chains``: a checkpoint's manifest,
    or its ``(operator, state, key group, chain)``): per (operator, state), in sorted order,
    consecutive key groups whose chains hold up to ``limit`` bytes (a key group of more is a
    run of its own; ``None``: :data:`SAVEPOINT_PACK_BYTES`)."""
    if limit is None:
        limit = SAVEPOINT_PACK_BYTES
    if isinstance(chains, Manifest):
        chains = [(op, st, kg, chain) for op, states in chains.keyed.items()
                  for st, by_kg in states.items() for kg, chain in by_kg.items()]
    packs: list[list[KeyGroupChain]] = []
    size = 0
    for item in sorted(chains, key=lambda c: (c[0], c[1], c[2])):
        chain_bytes = sum(ref.bytes for ref in item[3])
        if not packs or packs[-1][0][:2] != item[:2] or size + chain_bytes > limit:
            packs.append([])
            size = 0
        packs[-1].append(item)
        size += chain_bytes
    return packs


def write_savepoint_pack(source: Any, checkpoint_id: int, dest: Any, savepoint_id: int, pack: Sequence[KeyGroupChain],
                         before_read: Any = None, after_read: Any = None) -> Iterator[KeyGroupChain]:
    """Resolve every chain of ``pack`` (one of :func:`savepoint_packs`, read from checkpoint
    ``checkpoint_id`` of ``source``) and write its live rows into ``dest`` as bases of
    ``savepoint_id``, packed by :meth:`SnapshotStore.write_key_groups` (small key groups share
    a stream). Yields ``(operator, state, key group, new chain)`` of every key group, each chain
    one base: a key group whose keys were all deleted keeps an empty base (a full image over no
    chain is a base, whatever its rows: see :func:`storage.chain_decision.decide_chain`), as a
    savepoint has always named every key group of its checkpoint. Each chain is read when the
    writer comes to it, so about one pack of encoded bytes is held at once; ``before_read`` /
    ``after_read`` (no arguments) are called around each read (lease renewals, progress), one
    call at a time."""
    lock = threading.Lock()  # on an object store the writer reads on several threads

    def resolved(chain: Sequence[FileRef]) -> pa.Table:
        if before_read is not None:
            with lock:
                before_read()
        table = source.read_chain(list(chain), checkpoint_id=checkpoint_id)
        if after_read is not None:
            with lock:
                after_read()
        return table

    jobs = [KeyGroupWrite(op, st, kg, [], functools.partial(resolved, chain), True) for op, st, kg, chain in pack]
    for (op, st, kg, _), new in zip(pack, dest.write_key_groups(savepoint_id, jobs)):
        if len(new) != 1 or new[0].kind != "base":  # a full image over no chain is one base (decide_chain)
            raise StorageError(
                f"savepoint {savepoint_id}: {op}/{st} key group {kg} was written as {[r.kind for r in new]}, not as "
                "one base; nothing of this savepoint is committed; report this bug"
            )
        yield op, st, kg, new


def _files_of(dest: SavepointStore, checkpoint_id: int) -> list[str]:
    """Data files of ``dest`` written under ``checkpoint_id`` (also those of a copy that
    failed before it returned their names)."""
    out = []
    for path in dest.list_files():
        parsed = StoragePaths.parse(path)
        if parsed is not None and parsed.category in _DATA and parsed.checkpoint_id == checkpoint_id:
            out.append(path)
    return out


def _remove(dest: SavepointStore, paths: list[str]) -> None:
    for path in dict.fromkeys(paths):
        try:
            dest._io.delete(path)
        except StorageError:
            pass  # best effort: the marker (deleted last) says the copy is incomplete


def remove_incomplete_savepoints(dest: SavepointStore) -> list[CheckpointId]:
    """Remove what interrupted savepoint copies left in ``dest``: for every marker
    ``checkpoints/.sp-<id>.incomplete`` without a manifest ``<id>`` and without a live pin
    on ``<id>`` (a copy still running holds one), the data files of ``<id>``, then the
    marker. Returns the ids cleaned."""
    listing = dest.list_files()
    now = dest._now()
    live = [p for p in dest.pins() if p.live(now)]
    cleaned = []
    for path in sorted(listing):
        parsed = StoragePaths.parse(path)
        if parsed is None or parsed.category != "savepoint_incomplete":
            continue
        sid = parsed.checkpoint_id
        assert sid is not None
        if any(p.covers(sid) for p in live):
            continue  # a copy still running
        if StoragePaths.manifest(sid) in listing:  # committed; killed before it removed its marker
            _remove(dest, [path])
            continue
        _remove(dest, [*_files_of(dest, sid), path])
        cleaned.append(CheckpointId(sid))
    return cleaned


def copy_unkeyed(source: SavepointStore, manifest: Manifest, dest: SavepointStore,
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
