"""The runtime's errors, in the toolkit's one exception tree. Every class states its cause and
remedy.

The root :class:`AbsError` (and :class:`ConfigError`, with its subclass
:class:`ParallelismError` for the key-group math) is defined in the floor package
:mod:`abscore.errors` and handed on here. The storage layer's errors
(:class:`storage.StorageError` and below) and the recovery layer's
(:class:`recovery.RecoveryError` and below) derive from it too, so ``except abs.AbsError``
catches every error the toolkit raises on purpose.
"""
from __future__ import annotations

from abscore.errors import AbsError, ConfigError, ParallelismError
from storage.errors import MissingExtraError  # one class for every package: see storage.extras

__all__ = [
    "AbsError",
    "GraphError",
    "DuplicateUidError",
    "ConfigError",
    "ParallelismError",
    "JobFailedError",
    "WorkerLostError",
    "OperatorError",
    "StartupError",
    "CheckpointFailedError",
    "RepeatedOutputError",
    "StateError",
    "AlignmentError",
    "MissingExtraError",
    "ReconfigurationError",
]


class GraphError(AbsError, ValueError):
    """The dataflow graph is malformed (accidental cycle, dangling stream, bad edge).

    Remedy: fix the graph as the message says; cycles need the explicit iteration construct.
    """


class DuplicateUidError(GraphError):
    """Two operators share a uid. State is stored under uids, so they must be unique.

    Remedy: give each operator, source and sink its own ``uid``.
    """


class JobFailedError(AbsError, RuntimeError):
    """The job failed and could not (or was not allowed to) recover.

    ``result`` holds the :class:`abs.JobResult` with the checkpoints completed so far.
    """

    def __init__(self, message: str, result: object | None = None) -> None:
        super().__init__(message)
        self.result = result


class WorkerLostError(JobFailedError):
    """A worker process died or stopped answering (killed, out of memory, crashed)."""


class OperatorError(JobFailedError):
    """A user function raised inside an operator; the message names the operator uid and
    the worker, and carries the remote traceback."""


class StartupError(JobFailedError):
    """A job attempt failed while it started or restarted: between launching the workers and
    the first running state (a worker failed while connecting to its peers or restoring its
    state, e.g. a state file it could not read). The message names the worker, what it was
    doing, and the worker's own error; ``permanent`` says whether retrying would fail alike.

    Remedy: none while restarts are left (the restart strategy retries the attempt); otherwise
    fix the cause the message names, then run the job again with ``restore='latest'``.
    """

    def __init__(self, message: str, result: object | None = None, *, permanent: bool = False) -> None:
        super().__init__(message, result)
        self.permanent = permanent


class CheckpointFailedError(JobFailedError):
    """Checkpoints cannot complete: the job's final checkpoint failed again and again (its
    output since the last complete checkpoint would never be committed), or more consecutive
    checkpoints failed than ``CheckpointConfig.tolerable_failures`` allows. The message names
    the last failure's reason.

    The restart strategy fails the job over (restores the latest complete checkpoint with new
    workers and writers) while restarts are left. Remedy otherwise: fix the cause named (storage
    full or unreachable, a hung process), then run the job again with ``restore='latest'``.
    """


class RepeatedOutputError(JobFailedError):
    """A restore would publish again output that a sink already committed, and the sink cannot
    take it back: the checkpoint restored is older than checkpoints whose output the sink
    committed (newer ones were skipped as broken, or an older one was asked for), and the
    sink has no rollback (``Sink.supports_rollback``), or it is a :class:`abs.CollectSink`
    whose output went to an earlier process.

    Remedy: the message names the sink and the checkpoints. Repair the skipped checkpoint (or
    restore the newest one), write to a sink that can roll back (e.g. ``FileSink``), or pass
    ``allow_repeated_output=True`` to accept the repeated output.
    """


class StateError(AbsError, RuntimeError):
    """Keyed state was used in a way that cannot be right: a key group outside the backend's
    range, an undeclared state name, checkpoint ids that do not increase, a value that does not
    fit the state's declared Arrow type, or a table that cannot be restored.

    Remedy: the message names the operator, state and key group; fix the call (or the declared
    type) as it says. Key groups outside the range usually mean the routing table and the
    backend's key-group range disagree (a runtime bug).
    """


class AlignmentError(AbsError, RuntimeError):
    """The barrier aligner got an event that breaks the channel protocol: an unknown channel,
    an event from a blocked or already ended channel, a second end of stream.

    Remedy: this is a runtime bug (the runtime must not consume from blocked channels); the
    message names the channel and the checkpoint.
    """



class ReconfigurationError(ConfigError):
    """A live reconfiguration (``JobHandle.move``, ``rebalance``) that cannot be carried out:
    an unknown key group, a worker index out of range, a strategy without its batch size, one
    while another runs, or a job that restarted or ended before it was done. Nothing was
    changed by a refused request. Remedy: as the message says."""
