"""Failure injection: named fault points in the runtime where a test makes a worker crash
hard (``kill -9`` of itself) or hang (``SIGSTOP``), at the n-th hit, in a chosen attempt.

Fault points (``Fault.point``):

``during_alignment``      a barrier arrived on one channel, others have not delivered it yet
``before_snapshot``       a task reached a barrier (aligned), before its synchronous snapshot
``after_sync_snapshot``   after the synchronous part, before the barrier is forwarded
``after_barrier_forward`` the barrier went downstream, the upload has not started
``during_upload``         between two files of the asynchronous part
``before_ack``            every file is written, the ack is not sent
``process``               a batch is about to be processed (mid-processing)
``records``               a batch is about to be processed with which the task will have taken
                          ``nth`` records or more (the same point as ``process``, counted in
                          records: it does not depend on how the records were batched)
``before_commit``         (driver side) every ack is in, the manifest is not written
``after_commit``          (driver side) the manifest is written, completion not yet notified
``sink_commit``           a sink is about to publish a checkpoint's transactions
``restore``               a worker is reading its state during a restore
``before_connect``        a worker has its peers' addresses and opens no channel yet (its
                          peers are connecting to it): a peer killed while workers connect
``after_connect``         every channel of a worker is connected, its state is not restored
``before_handover``       (live reconfiguration) an old owner aligned a step, its key group is
                          not exported yet
``after_routing_switch``  a task forwarded a step's marker and routes to the new owners
``during_transfer``       an old owner exported and forgot a key group, its state is not sent
``before_install``        a new owner has a key group's state, not loaded yet
``after_install``         a new owner loaded a key group and processed its held records, the
                          driver does not know yet
``during_logging``        an iteration head logged a fed-back batch for an open checkpoint
``before_barrier_returns``  a barrier came round the loop to an iteration head, not handled yet
``during_log_upload``     an iteration head's log of a checkpoint is stored, not acked
``during_replay``         a restored iteration head is about to replay its logged records

The two connect points belong to a worker, not to a task: ``Fault.task`` ``"task<t>#<i>"``
(any ``t``) names worker ``i``, ``"*"`` every worker.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any, Iterable

__all__ = ["Fault", "FAULT_POINTS", "WORKER_POINTS", "normalize_faults", "trip"]

FAULT_POINTS = (
    "during_alignment",
    "before_snapshot",
    "after_sync_snapshot",
    "after_barrier_forward",
    "during_upload",
    "before_ack",
    "process",
    "records",
    "before_commit",
    "after_commit",
    "sink_commit",
    "restore",
    "before_connect",
    "after_connect",
    "before_handover",
    "after_routing_switch",
    "during_transfer",
    "before_install",
    "after_install",
    "during_split_handover",
    "before_retire",
    "during_logging",
    "before_barrier_returns",
    "during_log_upload",
    "during_replay",
)

WORKER_POINTS = ("before_connect", "after_connect")
"""Fault points of a worker as a whole (while it starts), not of one of its tasks."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """Crash (``action="kill"``: SIGKILL) or hang (``"hang"``: SIGSTOP) the process running
    ``task`` (``"task<t>#<subtask>"``, ``"*"`` for any; ``"driver"`` for driver points) at
    the ``nth`` hit of ``point``, during attempt ``attempt`` (0: the first run)."""

    point: str
    task: str = "*"
    nth: int = 1
    attempt: int = 0
    action: str = "kill"

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; use one of {', '.join(FAULT_POINTS)}")
        if self.action not in ("kill", "hang"):
            raise ValueError(f"fault action must be 'kill' or 'hang', got {self.action!r}")
        if self.nth < 1:
            raise ValueError(f"Fault.nth counts hits from 1, got {self.nth}")


def normalize_faults(faults: Iterable[Any]) -> tuple[Fault, ...]:
    """Accept :class:`Fault` objects or ``(point, task, nth[, attempt[, action]])`` tuples."""
    return tuple(f if isinstance(f, Fault) else Fault(*f) for f in faults)


def trip(fault: Fault) -> None:
    """Carry out ``fault`` on this process."""
    os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
