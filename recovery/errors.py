"""One exception tree for the recovery layer.

:class:`RecoveryError` derives from :class:`storage.errors.StorageError` (and so from the one
root ``abs.AbsError``), so code (and the ``abs-snapshot`` CLI) that already handles storage
errors handles these too. :class:`ParallelismError` is the floor's error of the key-group
math (:mod:`abscore.keygroups`), handed on here: it is a ``ConfigError``, not a
:class:`RecoveryError`. Every class states its cause and its remedy; messages name the object
(root, checkpoint, operator, file) and end with a verdict and an action. The errors of the
offline rewrites (:mod:`recovery.rewrite`, :mod:`recovery.spark`) close the module.

This module must not import ``abs``, nor the rest of ``recovery`` (:mod:`recovery.report`
imports it).
"""
from __future__ import annotations

from typing import Any, Protocol

from abscore.errors import ParallelismError
from storage.errors import StorageConfigError, StorageError

__all__ = [
    "RecoveryError",
    "IncompatibleSnapshotError",
    "CheckpointUnusableError",
    "NoUsableCheckpointError",
    "FingerprintFormatError",
    "ParallelismError",
    "RewriteError",
    "RewriteInputError",
    "DestinationNotEmptyError",
    "ExecutorStorageError",
    "SparkNotInstalledError",
    "MaxParallelismError",
    "UnpickleRefusedError",
]


class Report(Protocol):
    """What :class:`IncompatibleSnapshotError` carries: a
    :class:`recovery.report.CompatibilityReport` (named by this protocol, so that this module
    does not import :mod:`recovery.report`, which raises the error)."""

    @property
    def problems(self) -> tuple[Any, ...]: ...

    @property
    def ok(self) -> bool: ...

    @property
    def kinds(self) -> set[str]: ...

    def verdict(self) -> str: ...

    def lines(self) -> list[str]: ...


class RecoveryError(StorageError):
    """Root of every error the recovery layer raises on purpose."""


class IncompatibleSnapshotError(RecoveryError, ValueError):
    """The job cannot be restored from the snapshot as it stands: an operator uid with state
    is gone, a state was dropped or changed its kind or Arrow type, ``max_parallelism``
    differs, the parallelism is out of bounds, the snapshot's format is newer than this
    toolkit reads, operator state has no usable redistribution rule, or files are missing or
    corrupt.

    Remedy: each problem in the message (and in ``report``) says what to do: keep the operator
    uid or state declaration, pass ``allow_non_restored_state=True`` to drop state on purpose,
    re-key the snapshot offline into the new ``max_parallelism``, lower the parallelism,
    upgrade the toolkit, or restore from the named fallback checkpoint.
    """

    def __init__(self, message: str, report: Report | None = None) -> None:
        super().__init__(message)
        self.report = report


class CheckpointUnusableError(RecoveryError):
    """An explicitly requested checkpoint does not verify: a file it references is missing,
    torn or fails its checksum, or its manifest does not parse.

    Remedy: restore from ``fallback`` (the newest older checkpoint whose files verify, named in
    the message) or from a savepoint; ``abs-snapshot verify ROOT`` lists the intact ones.
    """

    def __init__(self, message: str, *, checkpoint_id: int, problems: tuple[Any, ...] = (),
                 fallback: int | None = None) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.problems = problems
        self.fallback = fallback


class NoUsableCheckpointError(RecoveryError, LookupError):
    """The snapshot root holds no complete checkpoint whose files verify (or none at all).

    Remedy: check the root URL; restore from a savepoint stored elsewhere; or start the job
    without restoring (its output since the last commit will then be produced again).
    """


class FingerprintFormatError(RecoveryError, ValueError):
    """A job fingerprint (what ``Dataflow.fingerprint()`` returns, or a ``--job`` JSON file)
    is not shaped as ``{"name", "max_parallelism", "operators": [{"uid", "kind", "state":
    [descriptor, ...]}]}``.

    Remedy: pass the dict returned by ``Dataflow.fingerprint()`` (``json.dump`` it for the CLI).
    """


# ============================================================================ offline rewrites
class RewriteError(RecoveryError):
    """An offline rewrite (compact / re-key) failed while reading, re-hashing or writing
    state: a key stored in the wrong key group, key groups whose schemas cannot be merged, a
    Spark task that failed. Nothing was committed: the destination holds no manifest.

    Remedy: the message names the file, state or key; fix the source (or restore from another
    checkpoint), delete the destination and run again.
    """


class RewriteInputError(RewriteError, StorageConfigError):
    """The rewrite was asked for something it cannot do (bad arguments); nothing was written."""


class DestinationNotEmptyError(RewriteInputError):
    """The destination already holds files (or is the source root). Remedy: pass a new, empty
    directory or prefix; ``abs-snapshot savepoint`` without ``--spark`` adds a savepoint to an
    existing root of the same job."""


class ExecutorStorageError(RewriteInputError):
    """A root the Spark executors cannot reach (``memory://`` lives inside one process).
    Remedy: use a path or URL every executor can open (local disk for ``local[*]``, S3, ...),
    or the in-process commands (without ``--spark``)."""


class SparkNotInstalledError(RewriteInputError):
    """``--spark`` was given but pyspark cannot be imported. Remedy: install the project with its
    ``spark`` extra (``pip install '.[spark]'`` in a checkout) and Java 17 in this Python, or run
    without ``--spark``."""


class MaxParallelismError(RewriteInputError, ParallelismError):
    """The new ``max_parallelism`` of a re-key is not an integer in ``[1, 32768]``."""


class UnpickleRefusedError(RewriteInputError):
    """A re-key met a state whose keys are pickled: hashing them again means unpickling them,
    which runs code from the snapshot, and the caller did not allow it. Nothing was written
    that a restore could see (no manifest).

    Remedy: if you trust the root, pass ``--unpickle`` (CLI) or ``unpickle=True`` (Python);
    otherwise do not re-key it. Compaction and savepoints never unpickle.
    """
