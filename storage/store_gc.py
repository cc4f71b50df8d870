"""Garbage collection of a snapshot root: gathering what :func:`storage.gc.plan_gc` decides
on (the listing, the manifests, the pins), and carrying a plan out.

The rules live in :mod:`storage.gc` (a pure plan); this module does the I/O around it: it
reads the root, plans, plans again when a pin appeared meanwhile, and deletes data files
first, manifests last, pins after them, every delete idempotent. Part of
:class:`storage.store.SnapshotStore`, which delegates ``plan_gc``, ``gc`` and ``execute_gc``
here.
"""
from __future__ import annotations

from typing import Callable, Iterable

from abscore.progress import ProgressCallback, Tracker

from .backend import RootIO
from .errors import UnsupportedFormatError
from .gc import GcPlan, plan_gc
from .manifest import FileRef
from .paths import StoragePaths
from .pins import read_pins
from .store_manifests import ManifestCatalog

__all__ = ["plan_root_gc", "run_gc", "execute_gc"]


def _category(path: str) -> str | None:
    parsed = StoragePaths.parse(path)
    return None if parsed is None else parsed.category


def plan_root_gc(io: RootIO, catalog: ManifestCatalog, clock: Callable[[], float], retain: int,
                 in_flight: Iterable[FileRef | str] = (), protect_newer_than: int | None = None, *,
                 as_of: int | None = None) -> GcPlan:
    """:meth:`SnapshotStore.plan_gc`: plan a GC of the root as it is listed now (no deletion)."""
    listing = io.list()
    paths = {}
    for path in listing:
        parsed = StoragePaths.parse(path)
        if parsed is not None and parsed.category == "manifest":
            assert parsed.checkpoint_id is not None
            if as_of is None or parsed.checkpoint_id <= as_of:
                paths[parsed.checkpoint_id] = path
    if as_of is not None and protect_newer_than is None:
        protect_newer_than = as_of
    manifests, errors = catalog.scan(paths)
    pins, bad_pins = read_pins(io, (p for p in listing if p.startswith(StoragePaths.PINS_DIR + "/")))
    return plan_gc(listing, manifests, retain=retain, in_flight=list(in_flight),
                   protect_newer_than=protect_newer_than,
                   unreadable={c: getattr(e, "reason", str(e)) for c, e in errors.items()
                               if not isinstance(e, UnsupportedFormatError)},
                   newer_format={c: str(e) for c, e in errors.items() if isinstance(e, UnsupportedFormatError)},
                   pins=pins, bad_pins=bad_pins, now=clock())


def run_gc(io: RootIO, catalog: ManifestCatalog, plan: Callable[[], GcPlan], *, dry_run: bool = False,
           progress: ProgressCallback | None = None) -> GcPlan:
    """:meth:`SnapshotStore.gc`: ``plan()`` (the store's :meth:`SnapshotStore.plan_gc` with the
    caller's arguments), and unless ``dry_run`` execute it; returns the plan executed."""
    planned = plan()
    if not dry_run and not planned.empty:
        # a pin taken while this plan was made (e.g. by a savepoint in another process)
        # is honoured if it shows up before the deletes start: plan again
        now_pinned = {p for p in io.list(StoragePaths.PINS_DIR) if _category(p) == "pin"}
        if now_pinned - set(planned.pins) - set(planned.delete_pins) - {p for p, _ in planned.bad_pins}:
            planned = plan()
        execute_gc(io, catalog, planned, progress=progress)
    return planned


def execute_gc(io: RootIO, catalog: ManifestCatalog, plan: GcPlan, *, progress: ProgressCallback | None = None) -> None:
    """:meth:`SnapshotStore.execute_gc`: carry out ``plan`` (idempotent); ``progress``: called
    per file deleted."""
    tracker = Tracker(progress, "gc: delete", len(plan.delete_files) + len(plan.delete_manifests)
                      + len(plan.delete_pins), "files")
    for path in plan.delete_files:
        io.delete(path)
        tracker.advance()
    for path in plan.delete_manifests:
        io.delete(path)
        catalog.forget(path)
        tracker.advance()
    for path in plan.delete_pins:
        io.delete(path)
        tracker.advance()
