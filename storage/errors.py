"""One exception tree for the storage layer.

Every error raised on purpose by :mod:`storage` derives from :class:`StorageError`
and, where one fits, from a built-in exception as well (so ``except FileNotFoundError``
or ``except ValueError`` keep working). Each class states its cause and the remedy.
Messages name the object (root, checkpoint, file) and end with a verdict and an action.

:class:`StorageError` derives from the one error root :class:`abscore.errors.AbsError`
(``abs.AbsError``), so ``except abs.AbsError`` catches storage errors too. This module must
not import ``abs`` or ``recovery``.
"""
from __future__ import annotations

from abscore.errors import AbsError, ConfigError

__all__ = [
    "StorageError",
    "StorageUnavailableError",
    "StorageConfigError",
    "JobMismatchError",
    "FingerprintError",
    "InvalidPathError",
    "CorruptFileError",
    "MissingFileError",
    "CorruptManifestError",
    "CorruptJobFileError",
    "UnsupportedFormatError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "StateNotFoundError",
    "DeltaSchemaError",
    "InvalidChainError",
    "GcRefusedError",
    "RootNotSharedError",
    "MissingExtraError",
]


class StorageError(AbsError):
    """Root of every error the storage layer raises on purpose (a :class:`AbsError`)."""


class StorageUnavailableError(StorageError, OSError):
    """The snapshot root cannot be reached: endpoint down, bucket missing, permission denied,
    or an I/O error from the file system.

    Remedy: check the URL, that the bucket/directory exists, the credentials and the network;
    the message carries the underlying error. Nothing was changed in storage.
    """


class StorageConfigError(StorageError, ValueError):
    """The URL or the ``storage_options`` cannot be used to build a file system
    (unknown protocol, unknown option, wrong type).

    Remedy: fix the option named in the message (``--storage-option key=value`` on the CLI).
    """


class RootNotSharedError(StorageConfigError):
    """A worker does not see the snapshot root the driver writes to: the probe file the driver
    wrote at start is missing or different where the worker looks (a relative or local path on
    a cluster resolves to each machine's own disk; a ``memory://`` root is per process).

    Remedy: use storage every worker and the driver share (an object store URL such as
    ``s3://bucket/prefix``, or a path on a file system mounted at the same place on every
    host). Nothing was written by the workers.
    """


class JobMismatchError(StorageError, ValueError):
    """A job tried to use a snapshot root that belongs to another job (different job name,
    ``max_parallelism`` or format version in ``_job.json``).

    Remedy: use another storage root, or restore/re-key the existing snapshots with the
    recovery tools instead of writing over them.
    """


class FingerprintError(StorageError, ValueError):
    """The job fingerprint handed to :meth:`SnapshotStore.init_job` lacks a required field
    (``job_name``, ``max_parallelism``) or is not JSON-serialisable.

    Remedy: pass a JSON-able dict with at least ``job_name`` (str) and
    ``max_parallelism`` (int >= 1).
    """


class InvalidPathError(StorageError, ValueError):
    """A storage path is not a plain relative POSIX path inside the root (absolute, contains
    ``..``, ``.``, empty segments, backslashes or a URL scheme), or a name cannot be encoded.

    Remedy: this is a bug in the caller or a tampered manifest; paths are only ever built
    by :class:`storage.paths.StoragePaths`.
    """


class CorruptFileError(StorageError):
    """A state, operator-state or channel file does not match its manifest entry (size,
    checksum, row count) or is not a readable Arrow IPC stream or file: a torn or altered write.

    Remedy: restore from an earlier checkpoint or a savepoint; run ``abs-snapshot verify``
    to see which checkpoints are affected.
    """


class MissingFileError(CorruptFileError, FileNotFoundError):
    """A file named by a manifest does not exist (lost write, deleted by hand or by a
    foreign tool).

    Remedy: restore from an earlier checkpoint or a savepoint whose files are intact
    (``abs-snapshot verify`` lists them).
    """


class CorruptManifestError(StorageError, ValueError):
    """A manifest (``checkpoints/chk-*.json``) or ``_job.json`` does not parse, is too large or
    too deeply nested, misses fields, holds out-of-range numbers, fails its own checksum
    (edited or damaged), or names files outside the root / of the wrong kind.

    Remedy: the checkpoint is unusable; restore from another checkpoint. If the manifest is
    garbage (e.g. written by hand), delete it. ``reason`` is a short form of the problem (for
    listings).
    """

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or "corrupt manifest"


class CorruptJobFileError(CorruptManifestError):
    """The root's ``_job.json`` does not read as a job fingerprint (it does not parse, is not
    an object, or holds out-of-range numbers). Unlike a checkpoint's manifest, which a restore
    falls back past, every attempt of the job reads the same bytes: a restart cannot help.

    Remedy: restore ``_job.json`` from a backup (or write it again from
    ``Dataflow.fingerprint()``), or use another storage root.
    """


class UnsupportedFormatError(StorageError):
    """A manifest or ``_job.json`` was written by a newer storage format than this code reads.

    Remedy: upgrade the toolkit to a version that reads the format version named in the
    message.
    """


class CheckpointExistsError(StorageError, FileExistsError):
    """A manifest with this checkpoint id already exists; ids are never reused.

    Remedy: take the next id from :meth:`SnapshotStore.next_checkpoint_id`.
    """


class CheckpointNotFoundError(StorageError, LookupError):
    """No complete checkpoint with the requested id exists in the root.

    Remedy: pick one of the ids listed by ``abs-snapshot ls ROOT``.
    """


class StateNotFoundError(StorageError, KeyError):
    """The manifest has no entry for the requested operator, state or key group.

    Remedy: check the names with ``abs-snapshot show ROOT ID``; a key group without an entry
    held no state at that checkpoint.
    """

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DeltaSchemaError(StorageError, ValueError):
    """A delta or state table handed to the store lacks a ``key`` column, has null keys, an
    ``op`` column that is not int8 with values 0 (upsert) / 1 (delete), or value columns that
    do not match the rest of the chain.

    Remedy: fix the caller (the runtime's snapshot encoder) to produce the documented schema.
    """


class InvalidChainError(StorageError, ValueError):
    """A chain of file references is malformed: it does not start with a base, mixes key
    groups / states, or its checkpoint ids go backwards.

    Remedy: pass the chain returned by the previous ``write_key_group`` or found in the last
    complete manifest, unchanged.
    """


class GcRefusedError(StorageError):
    """Garbage collection refused to run because it could not prove which files are
    referenced (a manifest of a newer format).

    Remedy: inspect the named manifest (``abs-snapshot verify``); delete it if it is garbage,
    or upgrade the toolkit; then run GC again. Nothing was deleted.
    """


class MissingExtraError(StorageConfigError, ConfigError, ImportError):
    """A feature needs an optional dependency (an *extra* of the project) that is not
    installed: pyspark for ``abs.SparkExecutor``, the Spark sources,
    :mod:`storage.spark` and :mod:`recovery.spark`; s3fs for ``s3://`` snapshot roots and
    ``s3://`` paths of the file connectors (see :mod:`storage.extras`).

    One class for every package: a :class:`StorageConfigError` (the CLI's usage errors), an
    ``abs.ConfigError`` and an ``ImportError`` (what a missing module raised before).

    Remedy: install the project with the extra the message names, e.g. ``pip install '.[spark]'``
    in a checkout.
    """
