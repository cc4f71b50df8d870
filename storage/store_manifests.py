"""The manifests of a snapshot root: listing, parsing (cached), the commit, checkpoint ids,
and the record of the newest committed checkpoint (``_committed.json``).

Part of :class:`storage.store.SnapshotStore`, which holds one :class:`ManifestCatalog` and
delegates its manifest methods to it. A manifest is the commit point of its checkpoint: it is
written once, atomically (:meth:`RootIO.put_new`), and never changes, so a parsed manifest is
cached by path until GC or a savepoint's deletion drops it (:meth:`ManifestCatalog.forget`).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Mapping

from .backend import RootIO
from .errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptManifestError, StorageError,
                     UnsupportedFormatError)
from .format import WRITE_CHECKSUM_ALGORITHM
from .ids import CheckpointId
from .manifest import FORMAT_VERSION, MAX_MANIFEST_BYTES, Manifest, manifest_problems
from .paths import StoragePaths
from .stats import storage_stats
from .store_job import JobRecord

__all__ = ["ManifestCatalog", "next_checkpoint_id", "record_committed", "recorded_committed"]


class ManifestCatalog:
    """The manifests under ``checkpoints/`` of one root (thread-safe)."""

    def __init__(self, io: RootIO) -> None:
        self._io = io
        self._lock = threading.Lock()
        self.cache: dict[str, Manifest] = {}
        """Parsed manifests by path (a manifest never changes once written)."""

    def forget(self, path: str) -> None:
        """Drop a deleted manifest from the cache."""
        with self._lock:
            self.cache.pop(path, None)

    # ------------------------------------------------------------------ listing
    def paths(self) -> dict[int, str]:
        """Every manifest file under ``checkpoints/``: id -> path, whether it parses or not."""
        out = {}
        for path in self._io.list(StoragePaths.CHECKPOINTS_DIR):
            parsed = StoragePaths.parse(path)
            if parsed is not None and parsed.category == "manifest":
                assert parsed.checkpoint_id is not None
                out[parsed.checkpoint_id] = path
        return out

    def load(self, paths: Mapping[int, str]) -> tuple[dict[int, Manifest], dict[int, str]]:
        """Parse the given manifests; returns (parsed by id, unreadable id -> reason)."""
        parsed, errors = self.scan(paths)
        return parsed, {cid: str(exc) for cid, exc in errors.items()}

    def scan(self, paths: Mapping[int, str]) -> tuple[dict[int, Manifest], dict[int, StorageError]]:
        """Parse the given manifests; returns (parsed by id, id -> the error of those that do not
        read: :class:`CorruptManifestError` or :class:`UnsupportedFormatError`)."""
        parsed: dict[int, Manifest] = {}
        bad: dict[int, StorageError] = {}
        for cid, path in sorted(paths.items()):
            try:
                parsed[cid] = self.read_path(cid, path)
            except (CorruptManifestError, UnsupportedFormatError) as exc:
                bad[cid] = exc
            except FileNotFoundError:
                continue  # deleted by a concurrent GC
        return parsed, bad

    def list_manifests(self) -> dict[CheckpointId, "Manifest | StorageError"]:
        """:meth:`SnapshotStore.list_manifests`: every manifest by id, parsed or its error."""
        parsed, bad = self.scan(self.paths())
        return {CheckpointId(cid): parsed.get(cid) or bad[cid] for cid in sorted({*parsed, *bad})}

    def complete_ids(self) -> list[CheckpointId]:
        """:meth:`SnapshotStore.list_checkpoints`: ids of the manifests that parse or are of a
        newer format, sorted."""
        out = []
        for cid, path in sorted(self.paths().items()):
            try:
                self.read_path(cid, path)
            except UnsupportedFormatError:
                pass
            except (CorruptManifestError, FileNotFoundError):
                continue
            out.append(CheckpointId(cid))
        return out

    # ------------------------------------------------------------------ reading
    def read(self, checkpoint_id: int) -> Manifest:
        """:meth:`SnapshotStore.read_manifest`; :class:`CheckpointNotFoundError` if there is none."""
        path = StoragePaths.manifest(checkpoint_id)
        try:
            return self.read_path(checkpoint_id, path)
        except FileNotFoundError:
            known = self.complete_ids()
            raise CheckpointNotFoundError(
                f"{self._io.url}: checkpoint {checkpoint_id} does not exist or is incomplete (no {path}); "
                f"complete checkpoints: {known[-10:] if known else 'none'}; pick one of those"
            ) from None

    def read_path(self, checkpoint_id: int, path: str) -> Manifest:
        """The manifest at ``path``, which must record ``checkpoint_id`` (cached)."""
        with self._lock:
            cached = self.cache.get(path)
        if cached is not None:
            return cached
        source = f"{self._io.url}: checkpoint {checkpoint_id}: manifest {path}"
        raw = self._io.get_document(path, MAX_MANIFEST_BYTES, source=source)
        manifest = Manifest.from_json(raw, source=source)
        if manifest.checkpoint_id != checkpoint_id:
            raise CorruptManifestError(
                f"{source}: records checkpoint id {manifest.checkpoint_id}; the manifest is corrupt or misplaced; "
                "restore from another checkpoint", reason=f"records checkpoint id {manifest.checkpoint_id}"
            )
        with self._lock:
            self.cache[path] = manifest
        return manifest

    # ------------------------------------------------------------------ commit
    def commit(self, manifest: Manifest, job: JobRecord) -> Manifest:
        """:meth:`SnapshotStore.commit`: check ``manifest`` (well formed, of ``job``), add the
        storage figures to its stats and write it atomically; returns it as stored."""
        if not isinstance(manifest, Manifest):
            raise TypeError(f"commit expects a Manifest, got {type(manifest).__name__}")
        cid = manifest.checkpoint_id
        problems = manifest_problems(manifest)
        if problems:
            path, message = problems[0]
            raise CorruptManifestError(
                f"checkpoint {cid}: refusing to commit a malformed manifest: {path + ': ' if path else ''}{message} "
                f"({len(problems)} problem(s)); fix the chains the runtime hands in"
            )
        known = job.known()
        if known is not None:
            job.check_same(known, manifest.job_name, manifest.max_parallelism, FORMAT_VERSION)
        stored = dataclasses.replace(manifest, format_version=FORMAT_VERSION,
                                     stats={**manifest.stats, **storage_stats(manifest)})
        path = StoragePaths.manifest(cid)
        text, stored.checksum = stored._encode()
        stored.checksum_algorithm = WRITE_CHECKSUM_ALGORITHM
        try:
            self._io.put_new(path, text.encode(), StoragePaths.manifest_temp(cid))
        except FileExistsError:
            raise CheckpointExistsError(
                f"{self._io.url}: checkpoint {cid} already has a manifest ({path}); another writer committed this id "
                "(a savepoint copied into this root meanwhile, or a second job writing it); ids are never reused; "
                "take the next id from next_checkpoint_id()"
            ) from None
        with self._lock:
            self.cache[path] = stored
        return stored


def next_checkpoint_id(io: RootIO) -> CheckpointId:
    """:meth:`SnapshotStore.next_checkpoint_id`: 1 + the highest id any file of the root names."""
    highest = 0
    for path in io.list():
        parsed = StoragePaths.parse(path)
        if parsed is not None and parsed.checkpoint_id is not None:
            highest = max(highest, parsed.checkpoint_id)
    return CheckpointId(highest + 1)


def record_committed(io: RootIO, checkpoint_id: int) -> None:
    """:meth:`SnapshotStore.record_committed`: write ``_committed.json``."""
    doc = {"checkpoint_id": int(checkpoint_id), "format_version": FORMAT_VERSION}
    io.put(StoragePaths.COMMIT_RECORD, json.dumps(doc).encode())


def recorded_committed(io: RootIO) -> CheckpointId | None:
    """:meth:`SnapshotStore.recorded_committed`: the id in ``_committed.json``, ``None`` without one."""
    try:
        raw = io.get_document(StoragePaths.COMMIT_RECORD, 1 << 12)
    except FileNotFoundError:
        return None
    try:
        cid = json.loads(raw)["checkpoint_id"]
        if not isinstance(cid, int) or isinstance(cid, bool) or cid < 1:
            raise ValueError(f"checkpoint_id {cid!r} is not an id >= 1")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptManifestError(
            f"{io.url}: {StoragePaths.COMMIT_RECORD} does not parse ({exc}); the record of the newest "
            "committed checkpoint is lost; delete the file once the root's checkpoints are known to be intact",
            reason="commit record does not parse",
        ) from exc
    return CheckpointId(cid)
