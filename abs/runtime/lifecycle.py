"""The job's life as the driver sees it, as a pure state machine: when the sources are all
exhausted, the final checkpoint; once it is complete, finishing the sources; once every task
is done, shutting down (a job with an iteration or unaligned checkpoints: once a final
checkpoint or probe found nothing in flight, see :mod:`abs.runtime.loops`); a worker that sends nothing for too long; and after a failure, a
restart or the end (failover).

No I/O, no clock of its own, no sleeps: the driver feeds it events and the current time
(``now``, from whatever clock it was given) and carries out the actions it returns. That makes
every rule here testable on its own (``tests/test_lifecycle.py`` drives it with random event
sequences).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

__all__ = [
    "FinishSources",
    "GiveUp",
    "JobLifecycle",
    "RequestFinalCheckpoint",
    "Restart",
    "ShutDown",
    "Stop",
    "TickCoordinator",
    "WorkerSilent",
    "failover",
]

MAX_FINAL_ATTEMPTS = 5
"""How many times the final checkpoint is requested before the job gives up."""


@dataclasses.dataclass(frozen=True)
class FinishSources:
    """Tell every source to end its input (the final checkpoint is complete, or the job
    does not checkpoint)."""


@dataclasses.dataclass(frozen=True)
class RequestFinalCheckpoint:
    """Ask the coordinator for a checkpoint: every source is exhausted and none is in flight."""

    attempt: int  # 1 for the first request


@dataclasses.dataclass(frozen=True)
class TickCoordinator:
    """Let the coordinator act on time (periodic triggers, timeouts)."""


@dataclasses.dataclass(frozen=True)
class ShutDown:
    """Every task is done: the workers report and exit."""


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """The final checkpoint failed ``attempts`` times."""

    attempts: int


@dataclasses.dataclass(frozen=True)
class WorkerSilent:
    """Worker ``worker`` sent nothing for ``silent_for`` seconds (more than the heartbeat timeout)."""

    worker: int
    silent_for: float


@dataclasses.dataclass(frozen=True)
class Restart:
    """Failover: run attempt ``attempt`` after ``delay`` seconds."""

    attempt: int
    delay: float


@dataclasses.dataclass(frozen=True)
class Stop:
    """No restart: the job ends with ``status`` (FAILED or CANCELED)."""

    status: str


class JobLifecycle:
    """One attempt of a job, from its start to its shutdown (see the module docstring)."""

    def __init__(self, tasks: Iterable[str], source_tasks: Iterable[str], workers: Iterable[int], *,
                 checkpointing: bool, heartbeat_timeout: float, now: float,
                 max_final_attempts: int = MAX_FINAL_ATTEMPTS, loops: bool = False, periodic: bool = False) -> None:
        self.tasks = frozenset(tasks)
        # a job with an iteration finishes only after a final checkpoint (or, without storage, a
        # termination probe) whose feedback logs were all empty: its loops are quiet; so does a
        # job with unaligned checkpoints (records an unaligned barrier overtook would be
        # processed after the final checkpoint, and their output never committed)
        self.loops = loops
        self.loop_rounds = 0  # final checkpoints/probes that found records circulating
        # after such a round a job with periodic checkpoints waits for the next periodic one
        # (the loops run on meanwhile: asking at once made the end of a loop job a string of
        # back-to-back checkpoints, each writing the state that changed)
        self.periodic = periodic
        self.wait_periodic = False
        self.source_tasks = frozenset(source_tasks)
        self.checkpointing = checkpointing
        self.heartbeat_timeout = heartbeat_timeout
        self.max_final_attempts = max_final_attempts
        self.last_seen = {w: now for w in workers}
        self.exhausted: set[str] = set()
        self.done: set[str] = set()
        self.final_from: int | None = None  # first checkpoint triggered after every source was exhausted
        self.finishing = False  # FinishSources was returned
        self.final_requests = 0

    # ------------------------------------------------------------------ queries
    @property
    def sources_exhausted(self) -> bool:
        return len(self.exhausted) == len(self.source_tasks)

    @property
    def all_done(self) -> bool:
        return len(self.done) == len(self.tasks)

    # ------------------------------------------------------------------ rescale
    def add_tasks(self, tasks: Iterable[str], source_tasks: Iterable[str], workers: Iterable[int], now: float) -> None:
        """Workers joined with their tasks (a rescale)."""
        self.tasks = self.tasks | frozenset(tasks)
        self.source_tasks = self.source_tasks | frozenset(source_tasks)
        self.last_seen.update({w: now for w in workers})

    def remove_tasks(self, tasks: Iterable[str], workers: Iterable[int]) -> None:
        """Workers left with their tasks (a rescale's retire step)."""
        gone = frozenset(tasks)
        self.tasks -= gone
        self.source_tasks -= gone
        self.exhausted -= gone
        self.done -= gone
        for w in workers:
            self.last_seen.pop(w, None)

    def on_splits_gained(self, task: str) -> None:
        """Source ``task`` was handed splits: it is reading again."""
        self.exhausted.discard(task)

    # ------------------------------------------------------------------ events
    def on_seen(self, worker: int, now: float) -> None:
        """A message of ``worker`` arrived."""
        self.last_seen[worker] = now

    def on_source_exhausted(self, task: str) -> bool:
        """True when this was the last source task to run out of input."""
        before = self.sources_exhausted
        self.exhausted.add(task)
        return self.sources_exhausted and not before

    def on_task_done(self, task: str) -> None:
        self.done.add(task)

    def on_triggered(self, checkpoint_id: int) -> None:
        if self.final_from is None and self.sources_exhausted:
            self.final_from = checkpoint_id
            self.wait_periodic = False

    def on_aborted(self, checkpoint_id: int) -> None:
        if self.final_from is not None and checkpoint_id >= self.final_from:
            self.final_from = None  # retry the final checkpoint

    def on_completed(self, checkpoint_id: int, quiet: bool = True) -> list:
        """``quiet``: no record circulated in a loop at this checkpoint's cut."""
        if self.final_from is not None and checkpoint_id >= self.final_from and not self.finishing:
            if self.loops and not quiet:
                self.final_from = None  # the loops still run: another round (not a failed attempt)
                self.final_requests = 0
                self.loop_rounds += 1
                self.wait_periodic = self.periodic
                return []
            self.finishing = True
            return [FinishSources()]
        return []

    def silent_workers(self, now: float) -> list[WorkerSilent]:
        return [WorkerSilent(w, now - seen) for w, seen in self.last_seen.items() if now - seen > self.heartbeat_timeout]

    def tick(self, checkpoints_pending: bool) -> list:
        """What to do after a round of messages; ``checkpoints_pending``: the coordinator has
        checkpoints in flight."""
        if self.all_done:
            return [ShutDown()]
        if self.finishing:
            return []
        if self.sources_exhausted:
            if not self.checkpointing and not self.loops:
                self.finishing = True
                return [FinishSources()]
            if self.final_from is None and not checkpoints_pending and not self.wait_periodic:
                self.final_requests += 1
                if self.final_requests > self.max_final_attempts:
                    return [GiveUp(self.max_final_attempts)]
                return [RequestFinalCheckpoint(self.final_requests), TickCoordinator()]
        return [TickCoordinator()]


def failover(attempt: int, *, canceled: bool, restartable: bool, max_restarts: int, delay: float) -> Restart | Stop:
    """After attempt ``attempt`` failed: restart it (``delay`` from the restart strategy) while
    the error is not permanent and restarts are left, else stop."""
    if canceled:
        return Stop("CANCELED")
    if not restartable or attempt >= max_restarts:
        return Stop("FAILED")
    return Restart(attempt + 1, delay)
