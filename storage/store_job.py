"""The job fingerprint of a snapshot root (``_job.json``): claiming the root, reading it back,
refusing another job, and the key-group range it implies.

Part of :class:`storage.store.SnapshotStore`, which holds one :class:`JobRecord` and
delegates ``init_job`` / ``read_job`` to it; the manifest commit and the key-group writes ask
it whether what they write belongs to this root's job.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from .backend import RootIO
from .errors import CorruptJobFileError, CorruptManifestError, FingerprintError, InvalidPathError, JobMismatchError, UnsupportedFormatError
from .manifest import FORMAT_VERSION, MAX_INT, MAX_MANIFEST_BYTES, parse_json_document
from .paths import StoragePaths

__all__ = ["JobRecord"]


class JobRecord:
    """The ``_job.json`` of one root, read at most once (thread-safe)."""

    def __init__(self, io: RootIO) -> None:
        self._io = io
        self._lock = threading.Lock()
        self._job: dict[str, Any] | None = None  # ``{}`` remembers an unclaimed root

    def init(self, fingerprint: Mapping[str, Any]) -> bool:
        """:meth:`SnapshotStore.init_job`: claim the root for a job (True), or check that it is
        this job's (False)."""
        url = self._io.url
        if not isinstance(fingerprint, Mapping):
            raise FingerprintError(f"job fingerprint must be a dict, got {type(fingerprint).__name__}")
        doc = dict(fingerprint)
        name = doc.get("job_name", doc.get("name"))
        max_par = doc.get("max_parallelism")
        if not isinstance(name, str) or not name:
            raise FingerprintError(f"{url}: job fingerprint lacks a 'job_name' string; add it")
        if not isinstance(max_par, int) or isinstance(max_par, bool) or max_par < 1:
            raise FingerprintError(f"{url}: job fingerprint has max_parallelism={max_par!r}; pass an integer >= 1")
        doc.update(job_name=name, max_parallelism=max_par, format_version=FORMAT_VERSION)
        try:
            data = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise FingerprintError(f"{url}: job fingerprint is not JSON-serialisable ({exc}); use plain JSON values") from exc
        try:
            self._io.put_new(StoragePaths.JOB, data, StoragePaths.job_temp())
        except FileExistsError:
            existing = self.read()
            if existing is None:  # deleted between our attempt and the read
                raise CorruptManifestError(f"{url}: _job.json vanished while being checked; retry") from None
            self.check_same(existing, name, max_par, FORMAT_VERSION)
            with self._lock:
                self._job = existing
            return False
        with self._lock:
            self._job = json.loads(data)
        return True

    def forget(self) -> None:
        """Drop the fingerprint kept in memory (its file was deleted)."""
        with self._lock:
            self._job = None

    def read(self) -> dict[str, Any] | None:
        """:meth:`SnapshotStore.read_job`: the stored fingerprint, or ``None`` when the root is unclaimed."""
        try:
            raw = self._io.get_document(StoragePaths.JOB, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        source = f"{self._io.url}: _job.json"
        try:
            doc = parse_json_document(raw, source=source, what="_job.json")
        except CorruptManifestError as exc:
            raise CorruptJobFileError(str(exc), reason=exc.reason) from None
        fix = "the root's job fingerprint is corrupt; restore it from a backup or use another storage root"
        if not isinstance(doc, dict):
            raise CorruptJobFileError(f"{source}: is not a JSON object; {fix}", reason="not a JSON object")
        for name in ("format_version", "max_parallelism"):
            value = doc.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_INT:
                raise CorruptJobFileError(f"{source}: {name} is out of range ({str(value)[:20]}...); {fix}",
                                          reason=f"{name} out of range")
        version = doc.get("format_version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{self._io.url}: _job.json has storage format version {version}, this toolkit reads up to "
                f"{FORMAT_VERSION}; upgrade to a release that supports format version {version}"
            )
        return doc

    def check_same(self, existing: Mapping[str, Any], name: str, max_par: int, version: int) -> None:
        """Refuse another job. A root created by an older format version this code reads
        (``_job.json`` is written once) is the same job: its new manifests carry the new version."""
        old = (existing.get("job_name"), existing.get("max_parallelism"), existing.get("format_version"))
        old_version = old[2]
        same_format = old_version == version or (
            isinstance(old_version, int) and not isinstance(old_version, bool) and 1 <= old_version <= FORMAT_VERSION)
        if old[:2] != (name, max_par) or not same_format:
            raise JobMismatchError(
                f"{self._io.url}: this storage root belongs to job {old[0]!r} (max_parallelism {old[1]}, format {old[2]}), "
                f"but job {name!r} (max_parallelism {max_par}, format {version}) tried to use it; refusing to mix them; "
                "use another storage root, or restore / re-key the existing job's snapshots"
            )

    def known(self) -> dict[str, Any] | None:
        """The job fingerprint, read once per store."""
        with self._lock:
            job = self._job
        if job is None:
            job = self.read() or {}
            with self._lock:
                self._job = job
        return job or None

    def check_key_group(self, key_group: int, what: str) -> None:
        """Refuse a key group outside ``[0, max_parallelism)`` of the root's job (if claimed)."""
        job = self.known()
        if job is not None and not 0 <= key_group < int(job.get("max_parallelism", key_group + 1)):
            raise InvalidPathError(
                f"{what}: key group {key_group} is outside [0, {job['max_parallelism']}) of job {job.get('job_name')!r}; "
                "compute key groups with the job's max_parallelism"
            )
