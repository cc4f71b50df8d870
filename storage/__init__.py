"""State-centric snapshot storage over fsspec (local disk, memory, S3).

Per operator, state and key group, checkpoints write Arrow IPC streams (zstd) holding either a
base or an incremental delta; manifests (JSON) list each key group's chain and are the commit
point. See ``storage/FORMAT.md`` for the on-disk format.

This package does not import ``abs`` or ``recovery``; it builds on the floor package ``abscore``
(key groups, typed ids, the file-schema names, the error root).
"""
from __future__ import annotations

from abscore.lazy import lazy_names as _lazy_names
from abscore.logs import package_logger as _package_logger

_package_logger("storage")  # warnings and notices reach stderr unless the application routes logging itself

from typing import TYPE_CHECKING

from . import errors

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use (below)
    from .chains import CompactionPolicy, resolve_chain
    from .errors import (
        CheckpointExistsError,
        CheckpointNotFoundError,
        CorruptFileError,
        CorruptManifestError,
        DeltaSchemaError,
        FingerprintError,
        GcRefusedError,
        InvalidChainError,
        InvalidPathError,
        JobMismatchError,
        MissingFileError,
        RootNotSharedError,
        StateNotFoundError,
        StorageConfigError,
        StorageError,
        StorageUnavailableError,
        UnsupportedFormatError,
    )
    from .format import KEY_COLUMN, META_KEY_ENCODING, META_VALUE_ENCODING, OP_COLUMN, OP_DELETE, OP_UPSERT
    from .gc import GcPlan, plan_gc
    from .ids import CheckpointId, KeyGroup, OperatorUid, StateName, SubtaskIndex
    from .manifest import FORMAT_VERSION, FileRef, Lineage, Manifest
    from .pins import PinLease, PinRecord
    from .paths import StoragePaths, decode_name, encode_name
    from .store import SnapshotStore
    from .session import CheckpointSession, KeyGroupCapture
    from .verify import Problem, VerifyReport

__all__ = [
    "SnapshotStore",
    "CheckpointSession",
    "KeyGroupCapture",
    "FileRef",
    "Manifest",
    "Lineage",
    "PinLease",
    "PinRecord",
    "CompactionPolicy",
    "VerifyReport",
    "Problem",
    "GcPlan",
    "plan_gc",
    "resolve_chain",
    "StoragePaths",
    "encode_name",
    "decode_name",
    "FORMAT_VERSION",
    "KEY_COLUMN",
    "OP_COLUMN",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "CheckpointId",
    "KeyGroup",
    "SubtaskIndex",
    "OperatorUid",
    "StateName",
    "errors",
    "StorageError",
    "StorageUnavailableError",
    "StorageConfigError",
    "RootNotSharedError",
    "JobMismatchError",
    "FingerprintError",
    "InvalidPathError",
    "CorruptFileError",
    "MissingFileError",
    "CorruptManifestError",
    "UnsupportedFormatError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "StateNotFoundError",
    "DeltaSchemaError",
    "InvalidChainError",
    "GcRefusedError",
]

_HOMES = {
    ".chains": ("CompactionPolicy", "resolve_chain"),
    ".errors": ("CheckpointExistsError", "CheckpointNotFoundError", "CorruptFileError", "CorruptManifestError",
                "DeltaSchemaError", "FingerprintError", "GcRefusedError", "InvalidChainError", "InvalidPathError",
                "JobMismatchError", "MissingFileError", "RootNotSharedError", "StateNotFoundError",
                "StorageConfigError", "StorageError", "StorageUnavailableError", "UnsupportedFormatError"),
    ".format": ("KEY_COLUMN", "META_KEY_ENCODING", "META_VALUE_ENCODING", "OP_COLUMN", "OP_DELETE", "OP_UPSERT"),
    ".gc": ("GcPlan", "plan_gc"),
    ".ids": ("CheckpointId", "KeyGroup", "OperatorUid", "StateName", "SubtaskIndex"),
    ".manifest": ("FORMAT_VERSION", "FileRef", "Lineage", "Manifest"),
    ".pins": ("PinLease", "PinRecord"),
    ".paths": ("StoragePaths", "decode_name", "encode_name"),
    ".store": ("SnapshotStore",),
    ".session": ("CheckpointSession", "KeyGroupCapture"),
    ".verify": ("Problem", "VerifyReport"),
}
# the public names load on first use: `import storage.errors` (as the runtime's error tree
# does) then costs no more than that module, and a job without a storage root imports neither
# the store nor fsspec
__getattr__, __dir__ = _lazy_names(__name__, globals(), _HOMES)
