"""Every message between the driver, the workers' control loops, their tasks, uploaders and
snapshot writer processes: one frozen dataclass per kind, dispatched by type.

What crosses a process boundary is pickled (``multiprocessing`` connections, the writer's
:func:`~abs.runtime.writer.send_frame`): the classes here hold plain values only and use
``slots`` to stay small. They travel on the checkpoint path and at start-up, never per record.

Start-up handshake (one authenticated control connection per worker)::

    worker -> driver   Hello(index, pid)
    driver -> worker   JobSpec(payload, assignment)   the job (shared) and this worker's part
    worker -> driver   Listening(address)             data-plane listener
    driver -> worker   Peers(addresses)
    worker -> driver   Ready(stats)                   channels connected, state restored
    driver -> worker   Start()

Then the driver sends :class:`TriggerCheckpoint`, :class:`CheckpointAborted`,
:class:`CheckpointCompleted`, :class:`Resume`, :class:`Finish`, :class:`Stop` and
:class:`Shutdown` (the first five also reach the tasks through their input gates), and the
worker reports :class:`Ack`, :class:`Decline`, :class:`SourceExhausted`, :class:`TaskDone`,
:class:`TaskFailed`, :class:`Collect`, :class:`CollectCommit`, :class:`Metrics` and finally
:class:`Done`. A worker and its snapshot writer process exchange :class:`WriterOpen`,
:class:`WriteSnapshot` (of :class:`WriteJob` values) and :class:`WriteDone` /
:class:`WriteFailed`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import AbsError

__all__ = [
    "Ack",
    "AddPeers",
    "ChannelAdded",
    "PeersAdded",
    "SplitsHandover",
    "CancelRequest",
    "InstallState",
    "KeyGroupHandover",
    "KeyGroupInstalled",
    "Preload",
    "ReconfigRequest",
    "StartStep",
    "CheckpointRequest",
    "CheckpointAborted",
    "CheckpointCompleted",
    "Collect",
    "CollectCommit",
    "Decline",
    "Done",
    "Finish",
    "Heartbeat",
    "Hello",
    "JobSpec",
    "Listening",
    "Metrics",
    "Peers",
    "ProtocolError",
    "Ready",
    "RestoreStats",
    "Resume",
    "Shutdown",
    "SourceExhausted",
    "Start",
    "Stop",
    "TaskAck",
    "TaskDone",
    "TaskFailed",
    "TriggerCheckpoint",
    "UploadJob",
    "WorkerAssignment",
    "WorkerMetrics",
    "WriteDone",
    "WriteFailed",
    "WriteJob",
    "WriteSnapshot",
    "WriterOpen",
    "unexpected",
]

_message = dataclasses.dataclass(frozen=True, slots=True)


class ProtocolError(AbsError, RuntimeError):
    """A process of the job got a message it does not know (or one out of turn): the driver
    and its workers run different versions of ``abs``, or a bug. Remedy: run the driver and
    every worker with the same installation of ``abs``; report it if they already do."""


def unexpected(msg: Any, receiver: str, sender: str, expected: str = "") -> ProtocolError:
    """The :class:`ProtocolError` for ``msg``, which ``receiver`` got from ``sender``."""
    wanted = f" (expected {expected})" if expected else ""
    return ProtocolError(
        f"{receiver}: got an unknown message {type(msg).__name__} ({msg!r:.200}) from {sender}{wanted}; "
        "the job stops; run the driver and every worker with the same version of abs"
    )


# ---------------------------------------------------------------------- start-up handshake
@_message
class WorkerAssignment:
    """What one worker owns of the job, from the restore plan (or the fresh split
    assignment): its source splits with their offsets, and on a restore exactly the chains of
    its own key groups and the operator state it re-commits."""

    subtask: int
    source_splits: dict  # source uid -> {split: offset}
    keyed_chains: dict | None = None  # uid -> state -> key group -> [FileRef]; None: nothing to restore
    sink_transactions: dict | None = None  # sink uid -> [transaction handle]
    key_groups: tuple | None = None  # the key groups it owns when not its default range (a joining worker: none)
    channel_logs: tuple = ()  # iteration heads' logged feedback records to replay first ([FileRef])


@_message
class Hello:
    index: int
    pid: int


@_message
class JobSpec:
    payload: bytes  # the cloudpickled WorkerSpec, the same for every worker
    assignment: WorkerAssignment


@_message
class Listening:
    address: tuple


@_message
class Peers:
    addresses: tuple


@_message
class RestoreStats:
    """What a worker restored: bytes and seconds, and per keyed operator and state the key
    groups it loaded (as received from the restore plan)."""

    bytes_restored: int = 0
    restore_seconds: float = 0.0
    key_groups: dict = dataclasses.field(default_factory=dict)  # uid -> state -> tuple of key groups


@_message
class Ready:
    stats: RestoreStats


@_message
class Start:
    pass


@_message
class Heartbeat:
    """A starting worker is alive (sent every ``worker_main.STARTUP_HEARTBEAT_S`` until :class:`Start`);
    ``restored_bytes``: what it has read of its state so far (restore progress)."""

    index: int
    restored_bytes: int = 0


# ---------------------------------------------------------------------- driver -> worker (and its tasks)
@_message
class TriggerCheckpoint:
    """Source tasks inject barrier ``checkpoint_id``; ``base`` is the newest checkpoint that
    was complete when it was triggered (see ``channels.Barrier``)."""

    checkpoint_id: int
    base: int = 0


@_message
class CheckpointAborted:
    checkpoint_id: int
    reason: str = ""


@_message
class CheckpointCompleted:
    checkpoint_id: int


@_message
class Resume:
    """Stop-the-world mode: sources paused after checkpoint ``checkpoint_id`` go on."""

    checkpoint_id: int


@_message
class Finish:
    """Every source ends its input (after the final checkpoint)."""


@_message
class Stop:
    """Stop at once (cancel, teardown)."""


@_message
class Shutdown:
    """Every task is done: report :class:`Done` and exit."""


# ---------------------------------------------------------------------- worker -> driver
@_message
class TaskAck:
    """A task's part of a checkpoint, as its uploader wrote it."""

    keyed: dict  # uid -> state -> key group -> [FileRef]
    source_offsets: dict  # uid -> {split: offset}
    sink_transactions: dict  # uid -> {subtask (str): transaction}
    bytes_written: int
    files_written: int
    async_cpu: float
    alignment_time: float = 0.0
    sync_time: float = 0.0
    async_time: float = 0.0
    # an iteration head's feedback log (abs.runtime.loops): its files, and how many records it
    # logged (none at every head: nothing circulated at the snapshot, the loop is quiet)
    channel_logs: tuple = ()
    loop_records: int | None = None
    channel_records: int = 0  # records an unaligned barrier overtook (channel state)
    # when (time.monotonic of the worker) the snapshot began, the uploader took it and the ack
    # went out: where a checkpoint's duration goes (CheckpointStats.phases)
    times: tuple = ()


@_message
class Ack:
    checkpoint_id: int
    task: str
    ack: TaskAck


@_message
class Decline:
    checkpoint_id: int
    task: str
    reason: str


@_message
class SourceExhausted:
    task: str
    splits_gained: int = 0  # how many split handovers the task had applied (a rescale's)


@_message
class TaskDone:
    task: str


@_message
class TaskFailed:
    """A task (or, with ``task`` ``"worker<i>"``, the worker itself) failed; ``phase``,
    ``cause`` and ``permanent`` are set for a failure while starting."""

    task: str
    uid: str
    traceback: str
    phase: str | None = None
    cause: str | None = None
    permanent: bool = False


@_message
class Collect:
    """A CollectSink epoch staged in the driver (see ``operators._CollectWriter``)."""

    key: str
    uid: str
    batches: list


@_message
class CollectCommit:
    keys: tuple


@_message
class WorkerMetrics:
    records_in: dict  # operator uid -> records
    bytes_written: int = 0
    bytes_restored: int = 0
    # task key -> (seconds since it started, of them idle, of them backpressured): Task.load()
    load: dict = dataclasses.field(default_factory=dict)
    lag: float | None = None  # records its sources are behind their input (None: none can tell)
    key_group_records: dict = dataclasses.field(default_factory=dict)  # keyed operator uid -> records per key group
    queue_fill: dict = dataclasses.field(default_factory=dict)  # task key -> share of its input buffers in use
    records_out: dict = dataclasses.field(default_factory=dict)  # operator uid -> rows it emitted


@_message
class Metrics:
    index: int
    metrics: WorkerMetrics


@_message
class Done:
    index: int
    metrics: WorkerMetrics


# ---------------------------------------------------------------------- JobHandle -> driver (in one process)
@_message
class CheckpointRequest:
    """Take a checkpoint now; its id (or the error) is put on ``reply``."""

    reply: Any  # queue.Queue


@_message
class CancelRequest:
    """Stop the job without a final checkpoint."""

    reply: Any  # queue.Queue


@_message
class ReconfigRequest:
    """Move key groups (:mod:`abs.reconfig`): ``kind`` "move" (``args``: key groups, worker) or
    "rebalance" (``args``: the assignment); the reconfiguration's record (or the error) is put
    on ``reply`` once its last step is installed."""

    kind: str
    args: tuple
    strategy: str
    batch: Any
    reply: Any  # queue.Queue


# ---------------------------------------------------------------------- live reconfiguration
# driver -> worker -> source tasks: StartStep; driver -> new owners: Preload, then the
# KeyGroupHandover the old owner sent the driver; installer thread -> task: InstallState;
# new owner -> driver: KeyGroupInstalled (see abs.reconfig)
@_message
class StartStep:
    """Source tasks inject :class:`~abs.runtime.channels.StepMarker` ``step``."""

    step: int
    moves: tuple  # ((key group, new owner), ...)
    base: int  # the newest complete checkpoint when the step started
    workers: int = 0  # a rescale's: the number of workers from this step on
    phase: str = ""  # a rescale's: "join", "drain" or "retire" (abs.reconfig.plan)
    split_moves: tuple = ()  # join/drain: ((source uid, from worker, to worker, splits), ...) to hand over


# ---------------------------------------------------------------------- rescale (abs.reconfig)
# A joining worker starts with the usual handshake (no splits, no key groups); meanwhile
# driver -> running workers: AddPeers; each connects its channels to the new workers, accepts
# theirs (every accepted channel reaches its task as ChannelAdded) and answers PeersAdded.
# Drain: leaving source task -> driver -> new owner's source task: SplitsHandover.
@_message
class AddPeers:
    """Workers ``first .. first + len(addresses) - 1`` joined: connect to them."""

    first: int
    addresses: tuple
    workers: int  # the number of workers with them


@_message
class PeersAdded:
    index: int


@_message
class ChannelAdded:
    """For a task: input channel ``channel`` joined (from a new worker)."""

    channel: int


@_message
class SplitsHandover:
    """Source ``operator``'s splits ``splits`` ({split: offset}) leave worker ``source`` for
    worker ``target`` at step ``step``."""

    step: int
    operator: str
    source: int
    target: int
    splits: dict


@_message
class Preload:
    """Read these chains ahead (Rhino): the state of key groups this worker is about to gain,
    as of checkpoint ``checkpoint_id``; the handover then carries only the changes since."""

    step: int
    checkpoint_id: int
    chains: dict  # operator uid -> state -> key group -> [FileRef]


@_message
class KeyGroupHandover:
    """Key group ``key_group`` of operator ``operator`` leaves worker ``source`` for worker
    ``target`` at step ``step``: ``changes`` (state -> Arrow IPC stream of a delta table) over
    ``chains`` (state -> the chain they build on; empty when the changes are everything)."""

    step: int
    operator: str
    key_group: int
    source: int
    target: int
    changes: dict
    chains: dict

    @property
    def full(self) -> bool:
        """The changes are the whole key group (nothing stored to build on)."""
        return not self.chains

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.changes.values())


@_message
class InstallState:
    """For the task running ``operator``: the state of ``key_group``, read and decoded."""

    step: int
    operator: str
    key_group: int
    base: dict  # state -> resolved table of the chain
    changes: dict  # state -> delta table
    read_bytes: int  # bytes read from storage for the base (0 when preloaded)


@_message
class KeyGroupInstalled:
    step: int
    operator: str
    key_group: int
    worker: int
    read_bytes: int


# ---------------------------------------------------------------------- task -> uploader (in one worker)
@_message
class UploadJob:
    """The asynchronous part of a task's snapshot, handed to its worker's uploader."""

    checkpoint_id: int
    task: Any  # the Task
    pieces: list  # [OpSnapshot]
    alignment_time: float
    sync_time: float
    snapshot_at: float = 0.0  # time.monotonic() when the snapshot began (barrier aligned, or trigger)


# ---------------------------------------------------------------------- worker <-> snapshot writer process
@_message
class WriteJob:
    """One key group of one state to write (see ``writer.write_jobs``)."""

    operator: str
    state: str
    key_group: int
    prev_chain: list
    delta: Any
    complete: bool

    def __reduce__(self) -> tuple:
        # a slots dataclass pickles through dataclasses.fields() per object (~5 us): one per
        # key group of every checkpoint, both ways
        return WriteJob, (self.operator, self.state, self.key_group, self.prev_chain, self.delta, self.complete)


@_message
class WriterOpen:
    storage_url: str
    storage_options: dict | None


@_message
class WriteSnapshot:
    checkpoint_id: int
    jobs: list  # [WriteJob]


@_message
class WriteDone:
    chains: list  # the new chain of every job, in job order
    cpu: float = 0.0


@_message
class WriteFailed:
    message: str
