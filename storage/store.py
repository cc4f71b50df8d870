"""``SnapshotStore``: the snapshot root as the runtime, recovery and the CLI see it."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import fsspec
import fsspec.core
import pyarrow as pa
from fsspec import AbstractFileSystem

from .backend import RootIO, protocols_of
from .chains import CompactionPolicy
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptManifestError,
    FingerprintError,
    InvalidPathError,
    JobMismatchError,
    MissingExtraError,
    RootNotSharedError,
    StorageConfigError,
    StorageError,
    UnsupportedFormatError,
)
from .extras import extra_for_url, missing_extra_message, missing_module
from .format import DEFAULT_DECODE_LIMITS, WRITE_CHECKSUM_ALGORITHM, DecodeLimits, EncodedFile
from .gc import GcPlan, plan_gc
from .pins import DEFAULT_PIN_TTL, PinLease, PinRecord, read_pins
from .ids import CheckpointId
from .manifest import FORMAT_VERSION, MAX_INT, MAX_MANIFEST_BYTES, FileRef, Manifest, manifest_problems, parse_json_document
from .paths import FileKind, StoragePaths, new_token
from .savepoint import take_savepoint
from .stats import storage_stats
from .store_read import ChainReader, key_group_chain
from .store_write import (PACK_LIMIT, KeyGroupWrite, KeyGroupWriter, put_file, write_channel_log, write_operator_state,
                          write_table)
from .verify import VerifyReport, check_files, lineage_problems, structural_problems

__all__ = ["KeyGroupWrite", "SnapshotStore"]

def _category(path: str) -> str | None:
    parsed = StoragePaths.parse(path)
    return None if parsed is None else parsed.category


class SnapshotStore:
    """A snapshot root (any fsspec URL) holding the checkpoints of one job.

    Build it with :meth:`open`. Thread-safe: the asynchronous snapshot part may write key
    groups from several threads at once.
    """

    def __init__(self, io: RootIO, *, policy: CompactionPolicy, clock: Callable[[], float] = time.time,
                 decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS) -> None:
        self._io = io
        self.policy = policy
        self.decode_limits = decode_limits
        self.pack_limit = PACK_LIMIT
        self._clock = clock
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._job: dict[str, Any] | None = None

    @property
    def _reader(self) -> ChainReader:
        return ChainReader(self._io, self.decode_limits)

    @property
    def _writer(self) -> KeyGroupWriter:
        return KeyGroupWriter(self._io, self._reader, self.policy, self.pack_limit, self._check_key_group)

    # ================================================================== opening
    @classmethod
    def open(
        cls,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        fs: AbstractFileSystem | None = None,
        policy: CompactionPolicy = CompactionPolicy(),
        clock: Callable[[], float] = time.time,
        fsync: bool = True,
        check: bool = True,
        decode_limits: DecodeLimits = DEFAULT_DECODE_LIMITS,
    ) -> "SnapshotStore":
        """Open the root at ``url`` (plain path, ``file://``, ``memory://``, ``s3://bucket/prefix``).

        ``storage_options`` go to the fsspec file system (s3fs: ``key``, ``secret``,
        ``endpoint_url``, ``client_kwargs``, ...). ``fs`` replaces the file system resolved from
        ``url`` (e.g. :class:`storage.testing.FaultyFileSystem`); ``url`` then only names the root.
        ``fsync`` makes local-disk writes durable before the manifest is written. ``check``
        lists the root once, so an unreachable endpoint or missing bucket fails here.
        ``decode_limits``: how far one state file may expand when read (see
        :class:`storage.format.DecodeLimits`).
        """
        if not isinstance(url, str) or not url:
            raise StorageConfigError(f"snapshot root {url!r} is not a URL or path; pass e.g. /data/ckpt or s3://bucket/prefix")
        options = dict(storage_options or {})
        try:
            if fs is None:
                fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
            else:
                root = fs._strip_protocol(url)
        except (ValueError, TypeError, ImportError, KeyError) as exc:
            extra = extra_for_url(url) if isinstance(exc, ImportError) else None
            if extra is not None:  # s3:// without s3fs
                raise MissingExtraError(missing_extra_message(f"snapshot root {url}", extra, missing_module(exc))) from exc
            raise StorageConfigError(
                f"{url}: cannot build a file system for this URL and storage options ({type(exc).__name__}: {exc}); "
                "check the URL scheme and the storage options"
            ) from exc
        if isinstance(root, list):
            raise StorageConfigError(f"{url}: names several paths; a snapshot root is one directory or prefix")
        store = cls(RootIO(fs, root, url, fsync=fsync), policy=policy, clock=clock, decode_limits=decode_limits)
        if check:
            try:
                store._io.list(StoragePaths.CHECKPOINTS_DIR)
            except TypeError as exc:  # some clients validate options lazily, on first use
                raise StorageConfigError(
                    f"{url}: the storage options were rejected ({exc}); fix them (e.g. --storage-option key=value)"
                ) from exc
        return store

    @property
    def url(self) -> str:
        return self._io.url

    @property
    def fs(self) -> AbstractFileSystem:
        return self._io.fs

    @property
    def object_store(self) -> bool:
        """Whether the root is on an object store (S3, GCS, Azure): a request's latency, not
        its bytes, dominates, so callers should issue requests concurrently."""
        return self._io.object_store

    def __repr__(self) -> str:
        return f"SnapshotStore({self.url!r})"

    def exists(self) -> bool:
        """True when the root holds a job fingerprint or any manifest."""
        return self._io.exists(StoragePaths.JOB) or bool(self._manifest_paths())

    def list_files(self) -> dict[str, int]:
        """Every file under the root: relative path -> size in bytes."""
        return self._io.list()

    # ================================================================== shared-root probe
    def write_probe(self) -> str:
        """Write a probe file with a fresh token (a driver, at start); returns the token.

        Every worker then calls :meth:`check_probe` on its own opening of the same URL: a
        worker that does not find the token there does not see the driver's root (a relative
        or machine-local path on a cluster, another process's ``memory://``).
        """
        token = new_token()
        self._io.put(StoragePaths.probe(token), token.encode())
        return token

    def check_probe(self, token: str, *, who: str = "this process") -> None:
        """Raise :class:`RootNotSharedError` unless the probe ``token`` is readable here."""
        try:
            seen = self._io.get(StoragePaths.probe(token))
        except FileNotFoundError:
            seen = None
        if seen != token.encode():
            what = "is missing" if seen is None else "holds another token"
            raise RootNotSharedError(
                f"{who} does not see the snapshot root {self.url!r} the driver writes to (the driver's probe file "
                f"{StoragePaths.probe(token)} {what} there); use storage that the driver and every worker share: "
                "an object store URL (s3://bucket/prefix) or a path mounted at the same place on every host"
            )

    def delete_probe(self, token: str) -> None:
        """Remove the probe file (idempotent)."""
        self._io.delete(StoragePaths.probe(token))

    # ================================================================== job fingerprint
    def init_job(self, fingerprint: Mapping[str, Any]) -> None:
        """Claim the root for a job, or check that it is this job's.

        ``fingerprint`` needs ``job_name`` (or ``name``) and ``max_parallelism``; anything else
        (operators, state descriptors) is stored as given by the first writer and not compared
        here. Raises :class:`JobMismatchError` when the root belongs to another job.
        """
        if not isinstance(fingerprint, Mapping):
            raise FingerprintError(f"job fingerprint must be a dict, got {type(fingerprint).__name__}")
        doc = dict(fingerprint)
        name = doc.get("job_name", doc.get("name"))
        max_par = doc.get("max_parallelism")
        if not isinstance(name, str) or not name:
            raise FingerprintError(f"{self.url}: job fingerprint lacks a 'job_name' string; add it")
        if not isinstance(max_par, int) or isinstance(max_par, bool) or max_par < 1:
            raise FingerprintError(f"{self.url}: job fingerprint has max_parallelism={max_par!r}; pass an integer >= 1")
        doc.update(job_name=name, max_parallelism=max_par, format_version=FORMAT_VERSION)
        try:
            data = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise FingerprintError(f"{self.url}: job fingerprint is not JSON-serialisable ({exc}); use plain JSON values") from exc
        try:
            self._io.put_new(StoragePaths.JOB, data, StoragePaths.job_temp())
        except FileExistsError:
            existing = self.read_job()
            if existing is None:  # deleted between our attempt and the read
                raise CorruptManifestError(f"{self.url}: _job.json vanished while being checked; retry") from None
            self._check_same_job(existing, name, max_par, FORMAT_VERSION)
            with self._lock:
                self._job = existing
            return
        with self._lock:
            self._job = json.loads(data)

    def read_job(self) -> dict[str, Any] | None:
        """The stored job fingerprint (``_job.json``), or ``None`` when the root is unclaimed."""
        try:
            raw = self._io.get_document(StoragePaths.JOB, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        source = f"{self.url}: _job.json"
        doc = parse_json_document(raw, source=source, what="_job.json")
        fix = "the root's job fingerprint is corrupt; restore it from a backup or use another storage root"
        if not isinstance(doc, dict):
            raise CorruptManifestError(f"{source}: is not a JSON object; {fix}", reason="not a JSON object")
        for name in ("format_version", "max_parallelism"):
            value = doc.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_INT:
                raise CorruptManifestError(f"{source}: {name} is out of range ({str(value)[:20]}...); {fix}",
                                           reason=f"{name} out of range")
        version = doc.get("format_version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{self.url}: _job.json has storage format version {version}, this toolkit reads up to "
                f"{FORMAT_VERSION}; upgrade to a release that supports format version {version}"
            )
        return doc

    def _check_same_job(self, existing: Mapping[str, Any], name: str, max_par: int, version: int) -> None:
        """Refuse another job. A root created by an older format version this code reads
        (``_job.json`` is written once) is the same job: its new manifests carry the new version."""
        old = (existing.get("job_name"), existing.get("max_parallelism"), existing.get("format_version"))
        old_version = old[2]
        same_format = old_version == version or (
            isinstance(old_version, int) and not isinstance(old_version, bool) and 1 <= old_version <= FORMAT_VERSION)
        if old[:2] != (name, max_par) or not same_format:
            raise JobMismatchError(
                f"{self.url}: this storage root belongs to job {old[0]!r} (max_parallelism {old[1]}, format {old[2]}), "
                f"but job {name!r} (max_parallelism {max_par}, format {version}) tried to use it; refusing to mix them; "
                "use another storage root, or restore / re-key the existing job's snapshots"
            )

    def _known_job(self) -> dict[str, Any] | None:
        """The job fingerprint, read once per store (``{}`` remembers an unclaimed root)."""
        with self._lock:
            job = self._job
        if job is None:
            job = self.read_job() or {}
            with self._lock:
                self._job = job
        return job or None

    # ================================================================== ids and listing
    def next_checkpoint_id(self) -> CheckpointId:
        """1 + the highest checkpoint id named by any file in the root (manifests, temporaries,
        state, operator-state and channel files of crashed attempts): ids are never reused."""
        highest = 0
        for path in self._io.list():
            parsed = StoragePaths.parse(path)
            if parsed is not None and parsed.checkpoint_id is not None:
                highest = max(highest, parsed.checkpoint_id)
        return CheckpointId(highest + 1)

    def manifest_ids(self) -> list[CheckpointId]:
        """Ids of every manifest file under ``checkpoints/``, sorted, whether it parses or not
        (:meth:`list_checkpoints` lists only those that parse)."""
        return sorted(CheckpointId(cid) for cid in self._manifest_paths())

    def record_committed(self, checkpoint_id: int) -> None:
        """Note ``checkpoint_id`` in ``_committed.json`` as the newest checkpoint whose sinks
        may have published output. Written after its manifest, before the sinks are told; it
        outlives a deleted newest manifest, so that a restore can tell that output above the
        checkpoint it restores exists (see :meth:`recorded_committed`)."""
        doc = {"checkpoint_id": int(checkpoint_id), "format_version": FORMAT_VERSION}
        self._io.put(StoragePaths.COMMIT_RECORD, json.dumps(doc).encode())

    def recorded_committed(self) -> CheckpointId | None:
        """The id :meth:`record_committed` wrote last; ``None`` when there is no record.
        Raises :class:`CorruptManifestError` when the record does not parse."""
        try:
            raw = self._io.get_document(StoragePaths.COMMIT_RECORD, 1 << 12)
        except FileNotFoundError:
            return None
        try:
            cid = json.loads(raw)["checkpoint_id"]
            if not isinstance(cid, int) or isinstance(cid, bool) or cid < 1:
                raise ValueError(f"checkpoint_id {cid!r} is not an id >= 1")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptManifestError(
                f"{self.url}: {StoragePaths.COMMIT_RECORD} does not parse ({exc}); the record of the newest "
                "committed checkpoint is lost; delete the file once the root's checkpoints are known to be intact",
                reason="commit record does not parse",
            ) from exc
        return CheckpointId(cid)

    def _manifest_paths(self) -> dict[int, str]:
        out = {}
        for path in self._io.list(StoragePaths.CHECKPOINTS_DIR):
            parsed = StoragePaths.parse(path)
            if parsed is not None and parsed.category == "manifest":
                assert parsed.checkpoint_id is not None
                out[parsed.checkpoint_id] = path
        return out

    def _load_manifests(self, paths: Mapping[int, str]) -> tuple[dict[int, Manifest], dict[int, str]]:
        """Parse the given manifests; returns (parsed by id, unreadable id -> reason)."""
        parsed, errors = self._scan_manifests(paths)
        return parsed, {cid: str(exc) for cid, exc in errors.items()}

    def _scan_manifests(self, paths: Mapping[int, str]) -> tuple[dict[int, Manifest], dict[int, StorageError]]:
        """Parse the given manifests; returns (parsed by id, id -> the error of those that do not
        read: :class:`CorruptManifestError` or :class:`UnsupportedFormatError`)."""
        parsed: dict[int, Manifest] = {}
        bad: dict[int, StorageError] = {}
        for cid, path in sorted(paths.items()):
            try:
                parsed[cid] = self._read_manifest_path(cid, path)
            except (CorruptManifestError, UnsupportedFormatError) as exc:
                bad[cid] = exc
            except FileNotFoundError:
                continue  # deleted by a concurrent GC
        return parsed, bad

    def list_manifests(self) -> dict[CheckpointId, "Manifest | StorageError"]:
        """Every manifest in the root by id, parsed, or the error it reads with
        (:class:`CorruptManifestError`: corrupt, not trusted; :class:`UnsupportedFormatError`:
        written by a newer format). For listings that must show corrupt checkpoints too."""
        parsed, bad = self._scan_manifests(self._manifest_paths())
        return {CheckpointId(cid): parsed.get(cid) or bad[cid] for cid in sorted({*parsed, *bad})}

    def list_checkpoints(self) -> list[CheckpointId]:
        """Ids of complete checkpoints (manifest exists and parses; savepoints included), sorted.

        Manifests of a newer format count as complete (reading them raises
        :class:`UnsupportedFormatError`); manifests that do not parse do not.
        """
        out = []
        for cid, path in sorted(self._manifest_paths().items()):
            try:
                self._read_manifest_path(cid, path)
            except UnsupportedFormatError:
                pass
            except (CorruptManifestError, FileNotFoundError):
                continue
            out.append(CheckpointId(cid))
        return out

    def latest_checkpoint(self) -> CheckpointId | None:
        ids = self.list_checkpoints()
        return ids[-1] if ids else None

    def read_manifest(self, checkpoint_id: int) -> Manifest:
        """The manifest of a complete checkpoint; :class:`CheckpointNotFoundError` if none."""
        path = StoragePaths.manifest(checkpoint_id)
        try:
            return self._read_manifest_path(checkpoint_id, path)
        except FileNotFoundError:
            known = self.list_checkpoints()
            raise CheckpointNotFoundError(
                f"{self.url}: checkpoint {checkpoint_id} does not exist or is incomplete (no {path}); "
                f"complete checkpoints: {known[-10:] if known else 'none'}; pick one of those"
            ) from None

    def _read_manifest_path(self, checkpoint_id: int, path: str) -> Manifest:
        with self._lock:
            cached = self._manifests.get(path)
        if cached is not None:
            return cached
        source = f"{self.url}: checkpoint {checkpoint_id}: manifest {path}"
        raw = self._io.get_document(path, MAX_MANIFEST_BYTES, source=source)
        manifest = Manifest.from_json(raw, source=source)
        if manifest.checkpoint_id != checkpoint_id:
            raise CorruptManifestError(
                f"{source}: records checkpoint id {manifest.checkpoint_id}; the manifest is corrupt or misplaced; "
                "restore from another checkpoint", reason=f"records checkpoint id {manifest.checkpoint_id}"
            )
        with self._lock:
            self._manifests[path] = manifest
        return manifest

    # ================================================================== writing
    def _check_key_group(self, key_group: int, what: str) -> None:
        job = self._known_job()
        if job is not None and not 0 <= key_group < int(job.get("max_parallelism", key_group + 1)):
            raise InvalidPathError(
                f"{what}: key group {key_group} is outside [0, {job['max_parallelism']}) of job {job.get('job_name')!r}; "
                "compute key groups with the job's max_parallelism"
            )

    def write_key_group(
        self,
        checkpoint_id: int,
        operator: str,
        state: str,
        key_group: int,
        prev_chain: Sequence[FileRef],
        delta: pa.Table,
        *,
        complete: bool = False,
        image: Callable[[], pa.Table | None] | None = None,
        over_base: FileRef | None = None,
    ) -> list[FileRef]:
        """Write the changes of one key group and return its new chain.

        ``delta`` has ``key``, value column(s) and ``op`` (int8, 0 upsert / 1 delete; absent =
        all upserts). Returns ``prev_chain + [delta file]``, or ``[new base]`` when
        ``prev_chain`` is empty (deletes of absent keys dropped) or the compaction policy
        says so. An empty delta on a non-empty chain writes nothing and returns ``prev_chain``.

        ``complete=True``: the writer guarantees that ``delta`` holds every live key of the key
        group as an upsert (a full image). It is written as the new base at once, without
        reading the previous chain, and the chain restarts at length 1; an image without rows
        returns ``[]`` (the key group holds no state any more).

        ``image``: when the policy compacts the chain, the store calls it for the key group's
        full live state at this checkpoint (a table like ``delta``, e.g. the writer's
        in-memory copy) and writes that as the new base instead of reading the previous chain
        back and resolving it; ``None`` from it falls back to reading.

        ``over_base`` (with ``complete``): the writer guarantees that the full image's keys are
        exactly the keys of this base file (e.g. it wrote that base from a key array that has
        not changed since). When it still heads ``prev_chain``, the image is written as a
        *values image* (format 4: the values alone, in the base's row order) and the chain
        becomes ``[base, values image]``: the keys are not written again. Falls back to a
        new base when the image does not qualify (keys not unique int64, another row count)
        or the compaction policy rejects the pair. Readers check the image's keys digest
        against the base, so a broken guarantee fails a restore loudly instead of mixing up
        values.
        """
        job = KeyGroupWrite(operator, state, key_group, prev_chain, delta, complete, image, over_base)
        return self._writer.write_key_group(checkpoint_id, job)

    def write_key_groups(self, checkpoint_id: int, jobs: Sequence["KeyGroupWrite"]) -> list[list[FileRef]]:
        """:meth:`write_key_group` for many key groups at once; returns the new chains in job order.

        Each job's chain is decided exactly as :meth:`write_key_group` decides it, but the new
        files of one (operator, state) are written *packed*: back to back, in key group order,
        into one file (``state/<op>/<state>/packed/<id>-<token>.arrow``; a new one once it
        holds :attr:`pack_limit` bytes), each referenced as a range of it
        (:attr:`FileRef.offset`). A pack of a single file is written as a file of its own.
        Why: a file costs a create on a local disk and a PUT on an object store, and a busy
        state changes every key group at every checkpoint. A job's ``delta`` may be a
        zero-argument callable returning the table, called when the job's turn comes, so that
        no more than about one pack of encoded bytes is held at once. On an object store the
        key groups are encoded on several threads (zstd and Arrow release the GIL). The first
        failing job raises; files already written are garbage for GC.
        """
        return self._writer.write_key_groups(checkpoint_id, jobs)

    def write_operator_state(self, checkpoint_id: int, operator: str, subtask: int, table: pa.Table) -> FileRef:
        """Write the operator (non-keyed) state of one subtask."""
        return write_operator_state(self._io, checkpoint_id, operator, subtask, table)

    def write_channel_log(self, checkpoint_id: int, task: str, table: pa.Table) -> FileRef:
        """Write the in-flight records a task logged on its back-edges for this checkpoint."""
        return write_channel_log(self._io, checkpoint_id, task, table)

    def commit(self, manifest: Manifest) -> Manifest:
        """Make checkpoint ``manifest.checkpoint_id`` complete by writing its manifest atomically.

        Adds the storage figures to ``stats`` (see :func:`storage.stats.storage_stats`; they
        override caller keys of the same name) and returns the manifest as stored. Raises
        :class:`CheckpointExistsError` if the id exists, :class:`JobMismatchError` if the manifest
        is of another job than ``_job.json``, :class:`CorruptManifestError` if it is malformed.
        """
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
        job = self._known_job()
        if job is not None:
            self._check_same_job(job, manifest.job_name, manifest.max_parallelism, FORMAT_VERSION)
        stored = dataclasses.replace(manifest, format_version=FORMAT_VERSION,
                                     stats={**manifest.stats, **storage_stats(manifest)})
        path = StoragePaths.manifest(cid)
        text, stored.checksum = stored._encode()
        stored.checksum_algorithm = WRITE_CHECKSUM_ALGORITHM
        try:
            self._io.put_new(path, text.encode(), StoragePaths.manifest_temp(cid))
        except FileExistsError:
            raise CheckpointExistsError(
                f"{self.url}: checkpoint {cid} already has a manifest ({path}); ids are never reused; "
                "take the next id from next_checkpoint_id()"
            ) from None
        with self._lock:
            self._manifests[path] = stored
        return stored

    # internal hooks for storage.savepoint, recovery and tests: write a file as is
    def _put(self, path: str, encoded: EncodedFile, kind: FileKind, checkpoint_id: int) -> FileRef:
        return put_file(self._io, path, encoded, kind, checkpoint_id)

    def _write_table(self, path: str, table: pa.Table, kind: FileKind, checkpoint_id: int) -> FileRef:
        return write_table(self._io, path, table, kind, checkpoint_id)

    # ================================================================== reading
    def read_bytes(self, ref: FileRef, *, checkpoint_id: int | None = None) -> bytes:
        """The raw bytes of a referenced file (or range of a packed file), after checking its
        size and checksum."""
        return self._reader.read_bytes(ref, checkpoint_id=checkpoint_id)

    def read_schema(self, ref: FileRef) -> pa.Schema:
        """The Arrow schema of a referenced file, from its first bytes (no checksum check, no
        decoding): cheap enough to tell a values image (no ``key`` column) from a delta."""
        return self._reader.read_schema(ref)

    def values_images(self, manifest: Manifest, unreadable: list[str] | None = None) -> set[str]:
        """:attr:`FileRef.id` of every values image of ``manifest`` (format 4: the delta right
        after a chain's base that holds the values of the base's rows, without keys). The
        manifest does not record it: the schema of each chain's second file is read. With
        ``unreadable``, a file whose schema cannot be read is appended to it (and counted as
        no values image) instead of raising."""
        return self._reader.values_images(manifest, unreadable)

    def read_file(self, ref: FileRef, *, checkpoint_id: int | None = None) -> pa.Table:
        """Read one file as a table (verified). Deltas keep their ``op`` column (absent when
        every row is an upsert)."""
        return self._reader.read_file(ref, checkpoint_id=checkpoint_id)

    def read_chain(self, chain: Sequence[FileRef], *, checkpoint_id: int | None = None) -> pa.Table:
        """Resolve a key group's chain: ``key`` + value columns, one row per live key.
        From an object store the chain's files are fetched concurrently."""
        return self._reader.read_chain(chain, checkpoint_id=checkpoint_id)

    def read_key_group(self, manifest: Manifest, operator: str, state: str, key_group: int) -> pa.Table:
        """Resolved state of one key group at ``manifest``'s checkpoint."""
        return self._reader.read_key_group(manifest, operator, state, key_group)

    def iter_key_group(self, manifest: Manifest, operator: str, state: str, key_group: int) -> Iterator[pa.RecordBatch]:
        """:meth:`read_key_group` as record batches, decoded lazily where the chain allows it
        (a base alone: one batch at a time, so a reader that stops early decodes no more);
        a longer chain is resolved as a whole first."""
        return self._reader.iter_key_group(manifest, operator, state, key_group)

    def read_key_group_chain(self, manifest: Manifest, operator: str, state: str, key_group: int) -> list[FileRef]:
        """The chain of one key group; :class:`StateNotFoundError` names what exists."""
        return key_group_chain(manifest, operator, state, key_group)

    # ================================================================== verify
    def verify(self, checkpoint_id: int | None = None) -> VerifyReport:
        """Check one checkpoint (or all manifests in the root): manifests parse and match their
        checksum, chains are well formed, every referenced file exists with its recorded size,
        checksum and row count, and each manifest follows its recorded predecessor where that is
        still here (see :mod:`storage.verify`)."""
        paths = self._manifest_paths()
        if checkpoint_id is not None:
            if checkpoint_id not in paths:
                raise CheckpointNotFoundError(
                    f"{self.url}: checkpoint {checkpoint_id} has no manifest; "
                    f"manifests present: {sorted(paths)[-10:] or 'none'}; pick one of those"
                )
            paths = {checkpoint_id: paths[checkpoint_id]}
        manifests, unreadable = self._load_manifests(paths)
        listing = self._io.list()
        problems = structural_problems(manifests, unreadable)
        predecessors = {m.lineage.previous_id for m in manifests.values() if m.lineage and m.lineage.previous_id}
        present = dict(manifests)
        present.update(self._load_manifests({p: StoragePaths.manifest(p) for p in predecessors - set(manifests)
                                             if StoragePaths.manifest(p) in listing})[0])
        problems.extend(lineage_problems(manifests, present))
        file_problems, files, nbytes = check_files(manifests, listing, self._io.get)
        problems.extend(file_problems)
        return VerifyReport(
            checkpoints=tuple(CheckpointId(c) for c in sorted(paths)),
            files_checked=files,
            bytes_checked=nbytes,
            problems=tuple(problems),
        )

    # ================================================================== retention
    def plan_gc(
        self,
        retain: int,
        in_flight: Iterable[FileRef | str] = (),
        protect_newer_than: int | None = None,
        *,
        as_of: int | None = None,
    ) -> GcPlan:
        """Plan a GC (no deletion); see :mod:`storage.gc` for the rules.

        ``in_flight``: files pending checkpoints may reference (new ones and the older files
        their chains build on). ``protect_newer_than``: unreferenced files of checkpoints above
        this id are kept (default: the newest complete checkpoint).

        ``as_of``: plan as if checkpoint ``as_of`` were the newest: manifests above it are
        neither counted nor dropped, and files above it are protected (``protect_newer_than``
        defaults to ``as_of``). A job's GC that runs in the background, behind new commits,
        passes the checkpoint whose commit asked for it, so that ``in_flight`` (computed at
        that commit) still covers every pending checkpoint the plan must spare.
        """
        listing = self._io.list()
        paths = {}
        for path in listing:
            parsed = StoragePaths.parse(path)
            if parsed is not None and parsed.category == "manifest":
                assert parsed.checkpoint_id is not None
                if as_of is None or parsed.checkpoint_id <= as_of:
                    paths[parsed.checkpoint_id] = path
        if as_of is not None and protect_newer_than is None:
            protect_newer_than = as_of
        manifests, errors = self._scan_manifests(paths)
        pins, bad_pins = read_pins(self._io, (p for p in listing if p.startswith(StoragePaths.PINS_DIR + "/")))
        return plan_gc(listing, manifests, retain=retain, in_flight=list(in_flight),
                       protect_newer_than=protect_newer_than,
                       unreadable={c: getattr(e, "reason", str(e)) for c, e in errors.items()
                                   if not isinstance(e, UnsupportedFormatError)},
                       newer_format={c: str(e) for c, e in errors.items() if isinstance(e, UnsupportedFormatError)},
                       pins=pins, bad_pins=bad_pins, now=self._clock())

    def pins(self) -> list[PinRecord]:
        """The pins of this root that read (live or expired; see :mod:`storage.pins`)."""
        return read_pins(self._io, self._io.list(StoragePaths.PINS_DIR))[0]

    def pin(self, first: int, last: int | None = None, *, ttl: float = DEFAULT_PIN_TTL, holder: str = "") -> PinLease:
        """Hold checkpoints ``first .. last`` (``last=None``: every id from ``first`` on) against
        every GC of this root, in any process, until the lease is released or expires
        (``ttl`` seconds, renewed by :meth:`PinLease.renew`). Use it as a context manager. A GC
        planned after this returns honours the pin; one planned before may still delete what
        it had planned to (see ``storage/FORMAT.md``, "Pins")."""
        import os
        import socket

        who = holder or "pin"
        return PinLease(self._io, self._clock, first, last, ttl=ttl,
                        holder=f"{who} ({socket.gethostname()} pid {os.getpid()})")

    def gc(
        self,
        retain: int,
        in_flight: Iterable[FileRef | str] = (),
        protect_newer_than: int | None = None,
        *,
        dry_run: bool = False,
        as_of: int | None = None,
    ) -> GcPlan:
        """Plan and (unless ``dry_run``) execute a GC: data files first, manifests last, each
        delete idempotent. Returns the plan. ``as_of``: see :meth:`plan_gc`."""
        in_flight = list(in_flight)
        plan = self.plan_gc(retain, in_flight, protect_newer_than, as_of=as_of)
        if not dry_run and not plan.empty:
            # a pin taken while this plan was made (e.g. by a savepoint in another process)
            # is honoured if it shows up before the deletes start: plan again
            now_pinned = {p for p in self._io.list(StoragePaths.PINS_DIR) if _category(p) == "pin"}
            if now_pinned - set(plan.pins) - set(plan.delete_pins) - {p for p, _ in plan.bad_pins}:
                plan = self.plan_gc(retain, in_flight, protect_newer_than, as_of=as_of)
            self.execute_gc(plan)
        return plan

    def execute_gc(self, plan: GcPlan) -> None:
        """Carry out a plan from :meth:`plan_gc` (idempotent)."""
        for path in plan.delete_files:
            self._io.delete(path)
        for path in plan.delete_manifests:
            self._io.delete(path)
            with self._lock:
                self._manifests.pop(path, None)
        for path in plan.delete_pins:
            self._io.delete(path)

    # ================================================================== savepoints
    def savepoint(
        self,
        checkpoint_id: int,
        dest_url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        fs: AbstractFileSystem | None = None,
        source_pin: PinLease | None = None,
    ) -> Manifest:
        """Write a self-contained, pinned copy of checkpoint ``checkpoint_id`` to ``dest_url``
        (may be this root). Without ``storage_options`` and ``fs``, a destination of the same
        protocol reuses this store's file system (and credentials). The checkpoint is pinned
        in this root while it is copied (``source_pin``: a lease the caller already holds on
        it). See :func:`storage.savepoint.take_savepoint`."""
        if storage_options is None and fs is None:
            protocol = fsspec.core.split_protocol(dest_url)[0] or "file"
            if protocol in protocols_of(self._io.fs):
                fs = self._io.fs
        dest = SnapshotStore.open(dest_url, storage_options, fs=fs, policy=self.policy, clock=self._clock,
                                  fsync=self._io.fsync)
        return take_savepoint(self, checkpoint_id, dest, source_pin=source_pin)

    def delete_savepoint(self, checkpoint_id: int) -> None:
        """Unpin a savepoint by deleting its manifest; the next GC reclaims its files."""
        manifest = self.read_manifest(checkpoint_id)
        if manifest.kind != "savepoint":
            raise StorageError(
                f"{self.url}: checkpoint {checkpoint_id} is a regular checkpoint, not a savepoint; "
                "nothing was deleted; retention (gc --retain) removes checkpoints"
            )
        path = StoragePaths.manifest(checkpoint_id)
        self._io.delete(path)
        with self._lock:
            self._manifests.pop(path, None)

    # internal hooks for storage.savepoint
    def _copy_in(self, data: bytes, ref: FileRef, path: str, checkpoint_id: int) -> FileRef:
        encoded = EncodedFile(data=data, rows=ref.rows, checksum=ref.checksum, checksum_algorithm=ref.checksum_algorithm)
        return self._put(path, encoded, ref.kind, checkpoint_id)

    def _now(self) -> float:
        return self._clock()

