"""Which failures the restart strategy retries: a pure decision over the exception.

A job attempt can fail anywhere from opening its storage root to its last record: the
driver opening the root or writing ``_job.json``, choosing and planning the restore,
launching and connecting the workers, the workers restoring their state, or a worker or user
function failing while the job runs. Most such failures are *transient* for the job: a peer
killed while the workers connect, an object store that does not answer, a disk that is full
for a while, a state file that cannot be read now. The restart strategy
(:class:`abs.RestartStrategy`) retries those with its delay and backoff.

Some failures are *permanent*: the same attempt would fail the same way however often it is
retried, because the job itself is wrong — a bad option, an incompatible graph or snapshot,
a storage root of another job, a snapshot format this toolkit cannot read, a module the
workers cannot import. Those fail the job at once with their own message, and use up no
restart.

:func:`is_permanent` is the one place that draws this line; the driver asks it about its own
exceptions, and a worker asks it about an exception it raised while starting (the answer
travels to the driver with the failure, see :class:`abs.errors.StartupError`).
"""
from __future__ import annotations

from ..errors import (
    CheckpointFailedError,
    ConfigError,
    GraphError,
    JobFailedError,
    OperatorError,
    StartupError,
    StateError,
    WorkerLostError,
)

__all__ = ["is_permanent", "should_restart", "describe"]


def _permanent_types() -> tuple[type, ...]:
    from recovery.errors import (
        CheckpointUnusableError,
        FingerprintFormatError,
        IncompatibleSnapshotError,
        NoUsableCheckpointError,
        ParallelismError,
    )
    from storage.errors import (
        CheckpointNotFoundError,
        CorruptJobFileError,
        FingerprintError,
        InvalidChainError,
        JobMismatchError,
        StorageConfigError,
        UnsupportedFormatError,
    )

    return (
        ConfigError,  # a bad option or config object
        GraphError,  # the dataflow itself is malformed
        StateError,  # state that does not fit its declaration (e.g. restored with another type)
        StorageConfigError,  # the URL / storage options cannot build a file system
        JobMismatchError,  # the root belongs to another job
        CorruptJobFileError,  # the root's _job.json does not read: every attempt reads the same bytes
        FingerprintError,
        UnsupportedFormatError,  # written by a newer toolkit
        CheckpointNotFoundError,  # restore= names a checkpoint that does not exist
        InvalidChainError,
        IncompatibleSnapshotError,  # operator uids, state types, max_parallelism do not match
        CheckpointUnusableError,  # restore= names a checkpoint whose files do not verify
        NoUsableCheckpointError,  # nothing in the root verifies: retrying reads the same files
        FingerprintFormatError,
        ParallelismError,
        ImportError,  # the workers cannot import the job's code (ship the module)
    )


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` would fail every retry of the attempt alike (see the module docstring).

    A :class:`~abs.errors.StartupError` carries the verdict a worker reached about its own
    exception."""
    if isinstance(exc, StartupError):
        return exc.permanent
    return isinstance(exc, _permanent_types())


def should_restart(exc: BaseException) -> bool:
    """Whether the restart strategy may retry the attempt that failed with ``exc``.

    Retried: a lost or failed worker, a user function that raised, a failure while the job
    started or restored, checkpoints that cannot complete (the final one, or more in a row
    than ``CheckpointConfig.tolerable_failures`` allows: a failover, as in Flink), and any
    other error that is not permanent (storage I/O above all). Not retried: permanent errors,
    interrupts (``KeyboardInterrupt``, ``SystemExit``), and any other
    :class:`~abs.errors.JobFailedError` (a verdict on the job itself)."""
    if not isinstance(exc, Exception) or is_permanent(exc):
        return False
    if isinstance(exc, (WorkerLostError, OperatorError, StartupError, CheckpointFailedError)):
        return True
    return not isinstance(exc, JobFailedError)


def describe(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``: the cause in one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
