"""``SnapshotStore``: the snapshot root as the runtime, recovery and the CLI see it.

The one public class of the storage layer's I/O. It holds the root's parts and delegates
each concept to the module that owns it:

- opening a root (fsspec set-up) and the shared-root probe: :mod:`storage.store_root`;
- the job fingerprint ``_job.json``: :mod:`storage.store_job` (:class:`JobRecord`);
- manifests (listing, reading, the commit, ids, the commit record):
  :mod:`storage.store_manifests` (:class:`ManifestCatalog`);
- writing key groups (chain plan, single and packed files), operator state and channel
  logs: :mod:`storage.store_write`;
- reading verified files and resolving chains: :mod:`storage.store_read`;
- GC (gathering, planning, executing): :mod:`storage.store_gc` over :mod:`storage.gc`;
  pins: :mod:`storage.pins`;
- savepoints: :mod:`storage.savepoint`; verification: :mod:`storage.verify`.
"""
from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa

from abscore.progress import ProgressCallback

from .backend import RootIO, protocols_of
from .chains import CompactionPolicy
from .errors import CheckpointNotFoundError, StorageConfigError, StorageError
from .format import DEFAULT_DECODE_LIMITS, DecodeLimits, EncodedFile
from .gc import GcPlan
from .ids import CheckpointId
from .manifest import FileRef, Manifest
from .paths import FileKind, StoragePaths
from .pins import DEFAULT_PIN_TTL, PinLease, PinRecord, read_pins
from .savepoint import take_savepoint
from .store_gc import execute_gc, plan_root_gc, run_gc
from .store_job import JobRecord
from .store_manifests import ManifestCatalog, next_checkpoint_id, record_committed, recorded_committed
from .store_read import ChainReader, SharedRangeCache, key_group_chain
from .store_root import check_probe, delete_probe, open_root, write_probe
from .store_write import (PACK_LIMIT, SHARE_BELOW, KeyGroupWrite, KeyGroupWriter, put_file, write_channel_log, write_operator_state,
                          write_table)
from .verify import VerifyReport, check_files, lineage_problems, removed_meanwhile, structural_problems

if TYPE_CHECKING:  # a local root needs no fsspec (see storage.backend): imported where a URL needs it
    from fsspec import AbstractFileSystem

__all__ = ["KeyGroupWrite", "SnapshotStore"]


_ROOT_DIRS = frozenset({StoragePaths.CHECKPOINTS_DIR, StoragePaths.STATE_DIR, StoragePaths.OPSTATE_DIR,
                        StoragePaths.CHANNELS_DIR, StoragePaths.PINS_DIR})
"""The directories of a snapshot root's own layout (a savepoint may not go inside one)."""
_SAVEPOINT_SIDE_DIRS = frozenset({"sources"})
"""What a job's savepoint writes beside the store's copy, before it (the logs of its sources,
``abs.connectors.batchlog_copies``): a destination holding only those is no stranger's."""


def _comparable(url: str) -> str:
    """A root's URL to compare with another's: a local path made absolute (``file://`` and
    relative paths alike), without a trailing slash."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        url = os.path.realpath(url)
    return url.rstrip("/")

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
        self.share_below = SHARE_BELOW
        self._shared_cache = SharedRangeCache()
        self._clock = clock
        self._job = JobRecord(io)
        self._catalog = ManifestCatalog(io)
        self._manifests = self._catalog.cache  # the parsed manifests by path

    @property
    def _reader(self) -> ChainReader:
        return ChainReader(self._io, self.decode_limits, self._shared_cache)

    @property
    def _writer(self) -> KeyGroupWriter:
        return KeyGroupWriter(self._io, self._reader, self.policy, self.pack_limit, self._job.check_key_group,
                              self.share_below)

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
        ``endpoint_url``, ``client_kwargs``, ...); a local root (a path or ``file://`` URL)
        takes none: any raises :class:`StorageConfigError` naming them. ``fs`` replaces the
        file system resolved from ``url`` (e.g. :class:`storage.testing.FaultyFileSystem`);
        ``url`` then only names the root.
        ``fsync`` makes local-disk writes durable before the manifest is written. ``check``
        lists the root once, so an unreachable endpoint or missing bucket fails here.
        ``decode_limits``: how far one state file may expand when read (see
        :class:`storage.format.DecodeLimits`).
        """
        io = open_root(url, storage_options, fs=fs, fsync=fsync, check=check)
        return cls(io, policy=policy, clock=clock, decode_limits=decode_limits)

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
        return self._io.exists(StoragePaths.JOB) or bool(self._catalog.paths())

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
        return write_probe(self._io)

    def check_probe(self, token: str, *, who: str = "this process") -> None:
        """Raise :class:`RootNotSharedError` unless the probe ``token`` is readable here."""
        check_probe(self._io, token, who=who)

    def delete_probe(self, token: str) -> None:
        """Remove the probe file (idempotent)."""
        delete_probe(self._io, token)

    # ================================================================== job fingerprint
    def init_job(self, fingerprint: Mapping[str, Any]) -> bool:
        """Claim the root for a job, or check that it is this job's; True when this call
        claimed it (wrote ``_job.json``).

        ``fingerprint`` needs ``job_name`` (or ``name``) and ``max_parallelism``; anything else
        (operators, state descriptors) is stored as given by the first writer and not compared
        here. Raises :class:`JobMismatchError` when the root belongs to another job.
        """
        return self._job.init(fingerprint)

    def unclaim_job(self) -> bool:
        """Undo :meth:`init_job`'s claim of a root nothing was written to since: delete
        ``_job.json`` when the root holds no manifest (a job that claimed it and then refused to
        start). True when it was deleted."""
        if self._catalog.paths():
            return False
        self._io.delete(StoragePaths.JOB)
        self._job.forget()
        return True

    def read_job(self) -> dict[str, Any] | None:
        """The stored job fingerprint (``_job.json``), or ``None`` when the root is unclaimed."""
        return self._job.read()

    # ================================================================== ids and listing
    def next_checkpoint_id(self) -> CheckpointId:
        """1 + the highest checkpoint id named by any file in the root (manifests, temporaries,
        state, operator-state and channel files of crashed attempts): ids are never reused."""
        return next_checkpoint_id(self._io)

    def manifest_ids(self) -> list[CheckpointId]:
        """Ids of every manifest file under ``checkpoints/``, sorted, whether it parses or not
        (:meth:`list_checkpoints` lists only those that parse)."""
        return sorted(CheckpointId(cid) for cid in self._catalog.paths())

    def dropped_meanwhile(self, checkpoint_ids: Iterable[int], *, patience: float = 0.0) -> set[int]:
        """Which of ``checkpoint_ids`` (read before) have no manifest any more: dropped since by a
        GC, such as the retention of a job writing this root; a file they lacked is then no fault
        of the data. A GC deletes a dropped checkpoint's data files first and its manifest last:
        with ``patience`` (seconds), a checkpoint whose manifest is still there is looked for
        again a few times over that long, so a missing file read in between is told apart."""
        wanted = set(checkpoint_ids)
        gone = wanted - set(self._catalog.paths())
        deadline, pause = time.monotonic() + patience, 0.1
        while gone != wanted and time.monotonic() < deadline:
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            pause *= 2
            gone = wanted - set(self._catalog.paths())
        return gone

    def record_committed(self, checkpoint_id: int) -> None:
        """Note ``checkpoint_id`` in ``_committed.json`` as the newest checkpoint whose sinks
        may have published output. Written after its manifest, before the sinks are told; it
        outlives a deleted newest manifest, so that a restore can tell that output above the
        checkpoint it restores exists (see :meth:`recorded_committed`)."""
        record_committed(self._io, checkpoint_id)

    def recorded_committed(self) -> CheckpointId | None:
        """The id :meth:`record_committed` wrote last; ``None`` when there is no record.
        Raises :class:`CorruptManifestError` when the record does not parse."""
        return recorded_committed(self._io)

    def list_manifests(self) -> dict[CheckpointId, "Manifest | StorageError"]:
        """Every manifest in the root by id, parsed, or the error it reads with
        (:class:`CorruptManifestError`: corrupt, not trusted; :class:`UnsupportedFormatError`:
        written by a newer format). For listings that must show corrupt checkpoints too."""
        return self._catalog.list_manifests()

    def list_checkpoints(self) -> list[CheckpointId]:
        """Ids of complete checkpoints (manifest exists and parses; savepoints included), sorted.

        Manifests of a newer format count as complete (reading them raises
        :class:`UnsupportedFormatError`); manifests that do not parse do not.
        """
        return self._catalog.complete_ids()

    def latest_checkpoint(self) -> CheckpointId | None:
        ids = self.list_checkpoints()
        return ids[-1] if ids else None

    def read_manifest(self, checkpoint_id: int) -> Manifest:
        """The manifest of a complete checkpoint; :class:`CheckpointNotFoundError` if none."""
        return self._catalog.read(checkpoint_id)

    # ================================================================== writing
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
        Files of fewer than :attr:`share_below` in-memory bytes (format 6) share one Arrow
        stream per kind and schema (a shared range: :attr:`FileRef.row_offset`), so that a
        small delta costs no stream of its own; ``share_below = 0`` turns that off.
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
        return self._catalog.commit(manifest, self._job)

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

    def read_range(self, chains: Sequence[Sequence[FileRef]], *,
                   checkpoint_id: int | None = None) -> tuple[pa.Table, list[tuple[int, int]]]:
        """Resolve many chains that are each one key group's rows of the same shared range of a
        packed file (format 6; the usual chain of a small key group after a full checkpoint):
        one table, and each chain's ``(row offset, rows)`` in it, what :meth:`read_chain` of
        that chain returns. The range is read, verified and decoded once, not once per key
        group. :class:`InvalidChainError` for a chain that is not one reference to that range."""
        return self._reader.read_range(chains, checkpoint_id=checkpoint_id)

    def read_key_group(self, manifest: Manifest, operator: str, state: str, key_group: int) -> pa.Table:
        """Resolved state of one key group at ``manifest``'s checkpoint."""
        return self._reader.read_key_group(manifest, operator, state, key_group)

    def iter_key_group(self, manifest: Manifest, operator: str, state: str, key_group: int) -> Iterator[pa.RecordBatch]:
        """:meth:`read_key_group` as record batches, decoded lazily where the chain allows it
        (a base alone: one batch at a time, so a reader that stops early decodes no more);
        a longer chain is resolved as a whole first. Either way the rows come in key order
        (where the key type sorts), as ``abs-snapshot dump`` lists them."""
        return self._reader.iter_key_group(manifest, operator, state, key_group)

    def read_key_group_chain(self, manifest: Manifest, operator: str, state: str, key_group: int) -> list[FileRef]:
        """The chain of one key group; :class:`StateNotFoundError` names what exists."""
        return key_group_chain(manifest, operator, state, key_group)

    # ================================================================== verify
    def verify(self, checkpoint_id: int | None = None, *, progress: ProgressCallback | None = None) -> VerifyReport:
        """Check one checkpoint (or all manifests in the root): manifests parse and match their
        checksum, chains are well formed, every referenced file exists with its recorded size,
        checksum and row count and decodes within this store's ``decode_limits``, and each
        manifest follows its recorded predecessor where that is still here (see
        :mod:`storage.verify`). ``progress``: called per file checked."""
        paths = self._catalog.paths()
        if checkpoint_id is not None:
            if checkpoint_id not in paths:
                raise CheckpointNotFoundError(
                    f"{self.url}: checkpoint {checkpoint_id} has no manifest; "
                    f"manifests present: {sorted(paths)[-10:] or 'none'}; pick one of those"
                )
            paths = {checkpoint_id: paths[checkpoint_id]}
        manifests, unreadable = self._catalog.load(paths)
        listing = self._io.list()
        problems = structural_problems(manifests, unreadable)
        predecessors = {m.lineage.previous_id for m in manifests.values() if m.lineage and m.lineage.previous_id}
        present = dict(manifests)
        present.update(self._catalog.load({p: StoragePaths.manifest(p) for p in predecessors - set(manifests)
                                           if StoragePaths.manifest(p) in listing})[0])
        problems.extend(lineage_problems(manifests, present))
        file_problems, files, nbytes = check_files(manifests, listing, self._io.get, progress=progress,
                                                  limits=self.decode_limits)
        problems.extend(file_problems)
        if problems:  # a GC running meanwhile (a job's retention) deletes files of checkpoints it drops
            checked = manifests.keys() | unreadable.keys()
            problems = removed_meanwhile(problems, self.dropped_meanwhile(checked))
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
        return plan_root_gc(self._io, self._catalog, self._clock, retain, in_flight, protect_newer_than, as_of=as_of)

    def gc(
        self,
        retain: int,
        in_flight: Iterable[FileRef | str] = (),
        protect_newer_than: int | None = None,
        *,
        dry_run: bool = False,
        as_of: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> GcPlan:
        """Plan and (unless ``dry_run``) execute a GC: data files first, manifests last, each
        delete idempotent. Returns the plan. ``as_of``: see :meth:`plan_gc`; ``progress``:
        called per file deleted."""
        in_flight = list(in_flight)
        plan = functools.partial(self.plan_gc, retain, in_flight, protect_newer_than, as_of=as_of)
        return run_gc(self._io, self._catalog, plan, dry_run=dry_run, progress=progress)

    def execute_gc(self, plan: GcPlan, *, progress: ProgressCallback | None = None) -> None:
        """Carry out a plan from :meth:`plan_gc` (idempotent); ``progress``: called per file deleted."""
        execute_gc(self._io, self._catalog, plan, progress=progress)

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

    # ================================================================== savepoints
    def savepoint(
        self,
        checkpoint_id: int,
        dest_url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        fs: AbstractFileSystem | None = None,
        source_pin: PinLease | None = None,
        progress: ProgressCallback | None = None,
    ) -> Manifest:
        """Write a self-contained, pinned copy of checkpoint ``checkpoint_id`` to ``dest_url``
        (may be this root). Without ``storage_options`` and ``fs``, a destination of the same
        protocol reuses this store's file system (and credentials). The checkpoint is pinned
        in this root while it is copied (``source_pin``: a lease the caller already holds on
        it). ``progress``: called per key group copied. See :func:`storage.savepoint.take_savepoint`."""
        if storage_options is None and fs is None:
            import fsspec.core

            protocol = fsspec.core.split_protocol(dest_url)[0] or "file"
            if protocol in protocols_of(self._io.fs):
                fs = self._io.fs
        dest = SnapshotStore.open(dest_url, storage_options, fs=fs, policy=self.policy, clock=self._clock,
                                  fsync=self._io.fsync)
        self._check_savepoint_dest(dest)
        return take_savepoint(self, checkpoint_id, dest, source_pin=source_pin, progress=progress)

    def _check_savepoint_dest(self, dest: "SnapshotStore") -> None:
        """Refuse a savepoint destination that would mix its files with others: a directory
        inside one of this root's own directories (``state/``, ``checkpoints/``, ...: the
        savepoint's files among the root's), or one that holds files but is no snapshot root.
        This root itself, an existing (savepoint) root and another directory under this root
        (a job's ``savepoints/``) are fine."""
        mine, theirs = _comparable(self.url), _comparable(dest.url)
        if theirs == mine:
            return
        if theirs.startswith(mine + "/") and theirs[len(mine) + 1:].split("/")[0] in _ROOT_DIRS:
            raise StorageConfigError(
                f"{dest.url}: is inside the source root's own directory {theirs[len(mine) + 1:].split('/')[0]}/; a "
                "savepoint there mixes its files with the root's; pass a directory outside the root (or the root "
                "itself, or a directory of its own under it such as savepoints/)"
            )
        if dest.exists():
            return
        files = sorted(f for f in dest.list_files() if f.split("/")[0] not in _SAVEPOINT_SIDE_DIRS)
        if files:
            sample = files[:3]
            raise StorageConfigError(
                f"{dest.url}: is not empty ({len(files)} file(s), e.g. {sample}) and holds no snapshots; refusing to "
                "mix a savepoint with other files; pass an empty directory, an existing savepoint root, or the root "
                "itself"
            )

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
        self._catalog.forget(path)

    # internal hooks for storage.savepoint
    def _copy_in(self, data: bytes, ref: FileRef, path: str, checkpoint_id: int) -> FileRef:
        encoded = EncodedFile(data=data, rows=ref.rows, checksum=ref.checksum, checksum_algorithm=ref.checksum_algorithm)
        return self._put(path, encoded, ref.kind, checkpoint_id)

    def _now(self) -> float:
        return self._clock()
