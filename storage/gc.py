"""Retention and garbage collection: a pure plan over a listing and the manifests.

Rules (see ``storage/FORMAT.md``):

1. Retained manifests: the ``retain`` newest checkpoints of kind ``checkpoint`` plus every
   savepoint (pinned) in the root. The others are *dropped*.
2. A file is *referenced* if a retained manifest or ``in_flight`` names it. Referenced files
   are never deleted.
3. An unreferenced file whose checkpoint id is greater than ``protect_newer_than`` (default:
   the newest complete checkpoint of kind ``checkpoint``; savepoints prove nothing) is
   *protected*: it may belong to a checkpoint still in flight. Only a later complete
   checkpoint proves it garbage.
4. Every other file written by this format is garbage. Files the format does not know are
   never touched. ``_job.json`` is never touched.
5. Execution deletes garbage data files first and the dropped manifests last (oldest first);
   every delete is idempotent, so a GC that dies half-way is finished by the next run.
   While it runs, a dropped checkpoint may already miss files: restore from retained ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .errors import GcRefusedError
from .ids import CheckpointId
from .manifest import FileRef, Manifest
from .paths import StoragePaths

__all__ = ["GcPlan", "plan_gc"]


@dataclass(frozen=True)
class GcPlan:
    """What a GC run deletes and keeps. Build with :func:`plan_gc`; execute with
    :meth:`SnapshotStore.gc`."""

    retain: int
    protect_newer_than: int
    retained: tuple[CheckpointId, ...]
    dropped: tuple[CheckpointId, ...]
    delete_files: tuple[str, ...]
    delete_manifests: tuple[str, ...]
    protected: tuple[str, ...]
    unknown: tuple[str, ...]
    bytes_freed: int
    packed_bytes_kept: int = 0
    """Size of the packed files kept (a packed file lives while any retained manifest needs
    any range of it)."""
    packed_bytes_live: int = 0
    """Bytes of those files' ranges that retained manifests (or in-flight checkpoints) reference;
    the rest is held only because it shares a file with a referenced range."""

    @property
    def empty(self) -> bool:
        return not self.delete_files and not self.delete_manifests

    def summary(self) -> str:
        return (
            f"retain {self.retain}: keep checkpoints {list(self.retained)}, drop {list(self.dropped)}; "
            f"delete {len(self.delete_files)} files and {len(self.delete_manifests)} manifests "
            f"({self.bytes_freed} bytes); {len(self.protected)} unreferenced files newer than checkpoint "
            f"{self.protect_newer_than} kept (may be in flight); {len(self.unknown)} unknown files left alone"
            + (f"; packed files kept: {self.packed_bytes_kept} bytes, {self.packed_bytes_live} of them referenced"
               if self.packed_bytes_kept else "")
        )


def plan_gc(
    listing: Mapping[str, int],
    manifests: Mapping[int, Manifest],
    *,
    retain: int,
    in_flight: Iterable[FileRef | str] = (),
    protect_newer_than: int | None = None,
    unreadable: Mapping[int, str] | None = None,
) -> GcPlan:
    """Plan a GC over ``listing`` (relative path -> size) and the parsed ``manifests`` by id.

    ``unreadable`` maps ids of manifests that exist but do not parse to the reason; any entry
    makes the plan refuse (:class:`GcRefusedError`): the files they reference are unknown.
    """
    if not isinstance(retain, int) or isinstance(retain, bool) or retain < 1:
        raise ValueError(f"retain={retain!r}: GC must keep at least the newest checkpoint; pass retain >= 1")
    if unreadable:
        cid, reason = sorted(unreadable.items())[0]
        raise GcRefusedError(
            f"checkpoint {cid}: manifest {StoragePaths.manifest(cid)} cannot be read ({reason}); GC refused so that "
            "no file it may reference is deleted, nothing was deleted; inspect it with 'abs-snapshot verify', delete it "
            "if it is garbage (or upgrade the toolkit if it is newer), then run GC again"
        )
    checkpoints = sorted((cid for cid, m in manifests.items() if m.kind == "checkpoint"), reverse=True)
    # only a completed *checkpoint* proves older attempts dead; a savepoint copied into this
    # root (possibly by another process, e.g. the CLI) proves nothing about the running job
    newest = checkpoints[0] if checkpoints else 0
    guard = newest if protect_newer_than is None else protect_newer_than
    retained = set(checkpoints[:retain]) | {cid for cid, m in manifests.items() if m.pinned}
    dropped = sorted(set(manifests) - retained)
    referenced: set[str] = {p for ref in in_flight for p in [ref.path if isinstance(ref, FileRef) else ref]}
    live_ranges: dict[str, FileRef] = {ref.id: ref for ref in in_flight if isinstance(ref, FileRef) and ref.packed}
    for cid in retained:
        referenced.update(manifests[cid].paths())  # a packed file while any range of it is needed
        live_ranges.update((ref.id, ref) for ref in manifests[cid].iter_refs() if ref.packed)
    packed_files = {ref.path for ref in live_ranges.values() if ref.path in listing}

    delete_files: list[str] = []
    delete_manifests: dict[int, str] = {}
    protected: list[str] = []
    unknown: list[str] = []
    for path in sorted(listing):
        parsed = StoragePaths.parse(path)
        if parsed is None:
            unknown.append(path)
            continue
        if parsed.category == "job":
            continue
        if parsed.category in ("job_tmp", "probe"):  # a probe is deleted by the driver that wrote it
            protected.append(path)
            continue
        cid = parsed.checkpoint_id
        assert cid is not None
        if parsed.category == "manifest":
            if cid in dropped:
                delete_manifests[cid] = path
            elif cid not in manifests:
                protected.append(path)  # appeared after the manifests were read
            continue
        if path in referenced:
            continue
        if cid > guard:
            protected.append(path)
        else:
            delete_files.append(path)
    ordered_manifests = [delete_manifests[cid] for cid in sorted(delete_manifests)]
    freed = sum(listing[p] for p in delete_files) + sum(listing[p] for p in ordered_manifests)
    return GcPlan(
        retain=retain,
        protect_newer_than=guard,
        retained=tuple(CheckpointId(c) for c in sorted(retained)),
        dropped=tuple(CheckpointId(c) for c in dropped),
        delete_files=tuple(delete_files),
        delete_manifests=tuple(ordered_manifests),
        protected=tuple(protected),
        unknown=tuple(unknown),
        bytes_freed=freed,
        packed_bytes_kept=sum(listing[p] for p in packed_files),
        packed_bytes_live=sum(ref.bytes for ref in live_ranges.values() if ref.path in packed_files),
    )
