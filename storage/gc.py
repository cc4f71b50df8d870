"""Retention and garbage collection: a pure plan over a listing, the manifests and the pins.

Rules (see ``storage/FORMAT.md``):

1. Retained manifests: the ``retain`` newest checkpoints of kind ``checkpoint``, every
   savepoint (pinned), and every checkpoint a live pin holds (``storage/pins.py``). The
   others are *dropped*.
2. A file is *referenced* if a retained manifest or ``in_flight`` names it. Referenced files
   are never deleted.
3. An unreferenced file whose checkpoint id is greater than ``protect_newer_than`` (default:
   the newest complete checkpoint of kind ``checkpoint``; savepoints prove nothing), or that
   a live pin holds, is *protected*: it may belong to a checkpoint still in flight (or being
   copied). Only a later complete checkpoint proves it garbage.
4. A manifest that does not read (corrupt: does not parse, fails its checksum, ...) is not
   trusted: it is not a checkpoint, protects no file, and is reported. Its own file is kept
   for inspection until it is older than every retained checkpoint of kind ``checkpoint``;
   then it is deleted like a dropped manifest. A manifest of a newer format makes the plan
   refuse (:class:`GcRefusedError`): a newer toolkit wrote it, and what it references is unknown.
5. Every other file written by this format is garbage. Files the format does not know are
   never touched. ``_job.json``, live and unreadable pins are never touched; expired pins
   are deleted.
6. Execution deletes garbage data files first and the dropped manifests last (oldest first);
   every delete is idempotent, so a GC that dies half-way is finished by the next run.
   While it runs, a dropped checkpoint may already miss files: restore from retained ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from abscore.units import human_bytes

from .errors import GcRefusedError
from .ids import CheckpointId
from .manifest import FileRef, Manifest
from .paths import StoragePaths
from .pins import PinRecord

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
    corrupt: tuple[tuple[CheckpointId, str], ...] = ()
    """Manifests that do not read, with the reason: not trusted, reported (see rule 4)."""
    held: tuple[CheckpointId, ...] = ()
    """Checkpoints retained only because a live pin holds them."""
    pins: tuple[str, ...] = ()
    """Live pins honoured."""
    delete_pins: tuple[str, ...] = ()
    """Expired pins (deleted with the manifests)."""
    bad_pins: tuple[tuple[str, str], ...] = ()
    """Pin files that do not read, with the reason: ignored and left alone."""

    @property
    def empty(self) -> bool:
        return not self.delete_files and not self.delete_manifests and not self.delete_pins

    def summary(self) -> str:
        return (
            f"retain {self.retain}: keep checkpoints {list(self.retained)}, drop {list(self.dropped)}; "
            f"delete {len(self.delete_files)} files and {len(self.delete_manifests)} manifests "
            f"({human_bytes(self.bytes_freed)})"
            + (f"; {len(self.protected)} unreferenced files newer than checkpoint {self.protect_newer_than} kept "
               "(may be in flight)" if self.protected else "")
            + f"; {len(self.unknown)} unknown files left alone"
            + (f"; packed files kept: {human_bytes(self.packed_bytes_kept)}, {human_bytes(self.packed_bytes_live)} of "
               "them referenced"
               if self.packed_bytes_kept else "")
            + (f"; held by {len(self.pins)} pin(s): checkpoints {list(self.held)}" if self.pins else "")
            + (f"; {len(self.delete_pins)} expired pin(s) deleted" if self.delete_pins else "")
            + "".join(f"; checkpoint {cid} has a corrupt manifest ({reason}): not trusted, protects no file"
                      for cid, reason in self.corrupt)
            + "".join(f"; pin {path} ignored ({reason})" for path, reason in self.bad_pins)
        )


def plan_gc(
    listing: Mapping[str, int],
    manifests: Mapping[int, Manifest],
    *,
    retain: int,
    in_flight: Iterable[FileRef | str] = (),
    protect_newer_than: int | None = None,
    unreadable: Mapping[int, str] | None = None,
    newer_format: Mapping[int, str] | None = None,
    pins: Iterable[PinRecord] = (),
    bad_pins: Mapping[str, str] | None = None,
    now: float = 0.0,
) -> GcPlan:
    """Plan a GC over ``listing`` (relative path -> size) and the parsed ``manifests`` by id.

    ``unreadable``: ids of manifests that exist but are corrupt, with the reason (rule 4: not
    trusted, reported). ``newer_format``: ids of manifests of a newer format: any entry makes
    the plan refuse (:class:`GcRefusedError`). ``pins``: the root's pins (those expired at
    ``now`` hold nothing and are deleted); ``bad_pins``: pin files that do not read.
    """
    if not isinstance(retain, int) or isinstance(retain, bool) or retain < 1:
        raise ValueError(f"retain={retain!r}: GC must keep at least the newest checkpoint; pass retain >= 1")
    if newer_format:
        cid, reason = sorted(newer_format.items())[0]
        raise GcRefusedError(
            f"checkpoint {cid}: manifest {StoragePaths.manifest(cid)} is of a newer format ({reason}); GC refused so "
            "that no file it may reference is deleted, nothing was deleted; upgrade the toolkit, then run GC again"
        )
    corrupt = dict(unreadable or {})
    pins = list(pins)
    live_pins = [p for p in pins if p.live(now)]
    checkpoints = sorted((cid for cid, m in manifests.items() if m.kind == "checkpoint"), reverse=True)
    # only a completed *checkpoint* proves older attempts dead; a savepoint copied into this
    # root (possibly by another process, e.g. the CLI) proves nothing about the running job
    newest = checkpoints[0] if checkpoints else 0
    guard = newest if protect_newer_than is None else protect_newer_than
    kept = set(checkpoints[:retain]) | {cid for cid, m in manifests.items() if m.pinned}
    held = {cid for cid in manifests if cid not in kept and any(p.covers(cid) for p in live_pins)}
    retained = kept | held
    dropped = sorted(set(manifests) - retained)
    # a corrupt manifest goes once a retained checkpoint is newer than it (nothing could still
    # build on it); before that its file stays for inspection
    oldest_kept = min(checkpoints[:retain]) if checkpoints else None
    drop_corrupt = {cid for cid in corrupt if oldest_kept is not None and cid < oldest_kept
                    and not any(p.covers(cid) for p in live_pins)}
    referenced: set[str] = {p for ref in in_flight for p in [ref.path if isinstance(ref, FileRef) else ref]}
    live_ranges: dict[str, FileRef] = {ref.id: ref for ref in in_flight if isinstance(ref, FileRef) and ref.packed}
    for cid in retained:
        referenced.update(manifests[cid].paths())  # a packed file while any range of it is needed
        live_ranges.update((ref.id, ref) for ref in manifests[cid].iter_refs() if ref.packed)
    packed_files = {ref.path for ref in live_ranges.values() if ref.path in listing}

    delete_files: list[str] = []
    delete_manifests: dict[int, str] = {}
    delete_pins: list[str] = []
    protected: list[str] = []
    unknown: list[str] = []
    pin_paths = {p.path: p for p in pins}
    for path in sorted(listing):
        parsed = StoragePaths.parse(path)
        if parsed is None:
            unknown.append(path)
            continue
        if parsed.category in ("job", "commit_record", "pin"):
            if path in pin_paths and not pin_paths[path].live(now):
                delete_pins.append(path)
            continue
        if parsed.category in ("job_tmp", "pin_tmp", "probe"):  # a probe is deleted by the driver that wrote it
            protected.append(path)
            continue
        cid = parsed.checkpoint_id
        assert cid is not None
        if parsed.category == "manifest":
            if cid in dropped or cid in drop_corrupt:
                delete_manifests[cid] = path
            elif cid not in manifests and cid not in corrupt:
                protected.append(path)  # appeared after the manifests were read
            continue
        if path in referenced:
            continue
        if cid > guard or any(p.covers(cid) for p in live_pins):
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
        corrupt=tuple((CheckpointId(c), r) for c, r in sorted(corrupt.items())),
        held=tuple(CheckpointId(c) for c in sorted(held)),
        pins=tuple(sorted(p.path for p in live_pins)),
        delete_pins=tuple(delete_pins),
        bad_pins=tuple(sorted((bad_pins or {}).items())),
    )
