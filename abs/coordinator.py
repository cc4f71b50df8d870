"""Checkpoint coordinator core: pure, event-driven, with an injected clock.

The driver feeds events in (``tick()``, acks, declines, commit results, task failures) and
carries out the actions that come back, in order:

* :class:`Trigger` ``(n)``: inject barrier ``n`` at every source task.
* :class:`Abort` ``(n, reason)``: checkpoint ``n`` will never complete; tell the tasks.
* :class:`Commit` ``(n, acks, ...)``: every expected task acknowledged ``n``; write manifest
  ``n`` (the commit point), then call :meth:`CheckpointCoordinator.on_committed` (or
  :meth:`~CheckpointCoordinator.on_commit_failed`).
* :class:`NotifyComplete` ``(n)``: tell the tasks that ``n`` is complete (sinks commit,
  state backends confirm).
* :class:`FailJob` ``(reason)``: more consecutive checkpoint failures than
  ``CheckpointConfig.tolerable_failures``.

Split as three small pieces: :class:`TriggerPolicy` (when to trigger), :class:`PendingCheckpoint`
(one in-flight checkpoint and its acks), :class:`CheckpointCoordinator` (ids, timeouts,
completion, subsumption, statistics).  All time comes from ``clock()``.

Ids strictly increase from ``first_id`` in trigger order and are never reused, even after an
abort (the runtime passes the storage's next id, so ids also increase across restarts).
Acks and declines for unknown, aborted or completed ids are ignored.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

from abs.config import CheckpointConfig
from abs.errors import ConfigError

__all__ = [
    "CheckpointCoordinator",
    "TriggerPolicy",
    "PendingCheckpoint",
    "CheckpointRecord",
    "Trigger",
    "Abort",
    "Commit",
    "NotifyComplete",
    "FailJob",
    "Action",
    "CHECKPOINT",
    "SAVEPOINT",
]

CHECKPOINT = "checkpoint"
SAVEPOINT = "savepoint"
_KINDS = (CHECKPOINT, SAVEPOINT)


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Trigger:
    """Start checkpoint ``checkpoint_id`` (inject barriers at the sources)."""

    checkpoint_id: int
    kind: str = CHECKPOINT
    triggered_at: float = 0.0


@dataclass(frozen=True)
class Abort:
    """Checkpoint ``checkpoint_id`` failed and will never complete."""

    checkpoint_id: int
    reason: str


@dataclass(frozen=True)
class Commit:
    """All expected tasks acknowledged: write manifest ``checkpoint_id`` from ``acks``."""

    checkpoint_id: int
    acks: dict[str, Any]
    started_at: float
    acked_at: float
    kind: str = CHECKPOINT


@dataclass(frozen=True)
class NotifyComplete:
    """Checkpoint ``checkpoint_id`` is durable: notify the tasks."""

    checkpoint_id: int


@dataclass(frozen=True)
class FailJob:
    """Too many consecutive checkpoint failures: fail the job."""

    reason: str


Action = Union[Trigger, Abort, Commit, NotifyComplete, FailJob]


@dataclass(frozen=True)
class CheckpointRecord:
    """Statistics of a finished checkpoint (completed or failed)."""

    checkpoint_id: int
    kind: str
    triggered_at: float
    ended_at: float
    reason: str | None = None  # None when completed
    acked_at: float | None = None

    @property
    def duration(self) -> float:
        return self.ended_at - self.triggered_at


# ----------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class TriggerPolicy:
    """When may the next checkpoint be triggered? Pure functions of the given times.

    * Periodic: due ``interval`` seconds after the previous trigger (or after start).
    * Capacity: fewer than ``max_concurrent`` checkpoints in flight; with ``min_pause > 0``
      at most one (the pause is measured from the end of the previous checkpoint).
    * ``min_pause`` applies to periodic triggers; on-request triggers bypass the interval and
      the pause but respect the capacity (they wait in a queue).
    """

    config: CheckpointConfig

    @property
    def capacity(self) -> int:
        return 1 if self.config.min_pause > 0 else self.config.max_concurrent

    def has_capacity(self, in_flight: int) -> bool:
        return in_flight < self.capacity

    def periodic_due_at(self, last_trigger: float) -> float | None:
        """Time the next periodic trigger is due, or None when periodic checkpoints are off."""
        interval = self.config.interval
        return None if interval is None else last_trigger + interval

    def pause_over_at(self, last_end: float | None) -> float | None:
        """Earliest time allowed by ``min_pause`` (None: no constraint)."""
        if last_end is None or self.config.min_pause <= 0:
            return None
        return last_end + self.config.min_pause

    def may_trigger_periodic(self, now: float, in_flight: int, last_trigger: float, last_end: float | None) -> bool:
        due = self.periodic_due_at(last_trigger)
        if due is None or now < due or not self.has_capacity(in_flight):
            return False
        pause = self.pause_over_at(last_end)
        return pause is None or now >= pause

    def may_trigger_request(self, in_flight: int) -> bool:
        return self.has_capacity(in_flight)

    def next_wakeup(self, in_flight: int, last_trigger: float, last_end: float | None) -> float | None:
        """When a periodic trigger could next happen (None: not before an event)."""
        due = self.periodic_due_at(last_trigger)
        if due is None or not self.has_capacity(in_flight):
            return None
        pause = self.pause_over_at(last_end)
        return due if pause is None else max(due, pause)


# ----------------------------------------------------------------------------- pending


@dataclass
class PendingCheckpoint:
    """One in-flight checkpoint: who must acknowledge it, and what came back."""

    checkpoint_id: int
    kind: str
    triggered_at: float
    expected: frozenset[str]
    acks: dict[str, Any] = field(default_factory=dict)
    declines: dict[str, str] = field(default_factory=dict)
    acked_at: float | None = None
    committing: bool = False  # Commit emitted, waiting for on_committed / on_commit_failed

    def ack(self, task: str, payload: Any, now: float) -> bool:
        """Record an ack; True when it was the last one missing. Unexpected or repeated acks
        are ignored."""
        if self.committing or task not in self.expected or task in self.acks:
            return False
        self.acks[task] = payload
        if len(self.acks) == len(self.expected):
            self.acked_at = now
            return True
        return False

    @property
    def missing(self) -> frozenset[str]:
        return self.expected - self.acks.keys()

    def timed_out(self, now: float, timeout: float) -> bool:
        return not self.committing and now - self.triggered_at >= timeout


# ----------------------------------------------------------------------------- coordinator


class CheckpointCoordinator:
    """Decides when checkpoints start, end and fail; emits actions for the driver.

    ``expected_tasks``: ids of the tasks that must acknowledge each checkpoint.
    ``first_id``: id of the first checkpoint (above every id in storage).
    ``clock``: monotonic seconds (``time.monotonic`` in production, a manual clock in tests).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        expected_tasks: Iterable[str],
        first_id: int,
        clock: Callable[[], float],
    ) -> None:
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"CheckpointCoordinator needs a CheckpointConfig, got {config!r}")
        if type(first_id) is not int or first_id < 1:
            raise ConfigError(
                f"CheckpointCoordinator first_id must be an int >= 1, got {first_id!r}; pass "
                "the storage's next checkpoint id"
            )
        self.config = config
        self.policy = TriggerPolicy(config)
        self._clock = clock
        self._expected: set[str] = set(expected_tasks)
        self._next_id = first_id
        self._pending: dict[int, PendingCheckpoint] = {}
        self._requests: deque[str] = deque()
        self._outbox: list[Action] = []
        # set by the driver while a live reconfiguration step is in flight: a periodic
        # checkpoint waits for the step's end (a task that aligns a barrier while key groups
        # are on their way to it waits for them, which would stall its other keys too)
        self.defer_periodic = False
        self._start = clock()
        self._last_trigger = self._start
        self._last_end: float | None = None
        self._latest_notified: int | None = None
        self._consecutive_failures = 0
        self._job_failed = False
        self.completed: list[CheckpointRecord] = []
        self.failed: list[CheckpointRecord] = []

    # ------------------------------------------------------------------ views
    @property
    def next_id(self) -> int:
        """Id the next triggered checkpoint will get."""
        return self._next_id

    @property
    def expected_tasks(self) -> frozenset[str]:
        """Tasks that future checkpoints wait for."""
        return frozenset(self._expected)

    def pending_ids(self) -> tuple[int, ...]:
        """Ids of in-flight checkpoints (triggered, not completed nor aborted), ascending."""
        return tuple(self._pending)

    def pending(self, checkpoint_id: int) -> PendingCheckpoint | None:
        return self._pending.get(checkpoint_id)

    def queued_requests(self) -> int:
        return len(self._requests)

    def queued_id(self) -> int | None:
        """Id the most recently queued request will get (None when none is queued).

        Queued requests are triggered first-in first-out, before any periodic checkpoint, so
        their ids are known in advance.
        """
        if not self._requests:
            return None
        return self._next_id + len(self._requests) - 1

    def next_deadline(self) -> float | None:
        """Earliest time at which :meth:`tick` has something to do (a timeout or a periodic
        trigger); None when only an event can change anything. Lets the driver sleep."""
        times = [p.triggered_at + self.config.timeout for p in self._pending.values() if not p.committing]
        wake = self.policy.next_wakeup(len(self._pending), self._last_trigger, self._last_end)
        if wake is not None:
            times.append(wake)
        return min(times) if times else None

    # ------------------------------------------------------------------ triggering
    def request(self, kind: str = CHECKPOINT) -> int | None:
        """Ask for a checkpoint (or savepoint) now, bypassing the interval and ``min_pause``.

        Returns its id when it is triggered at once (the :class:`Trigger` action comes out of
        the next :meth:`tick`), or None when ``max_concurrent`` checkpoints are in flight: the
        request is queued (its id: :meth:`queued_id`) and triggered when capacity frees up
        (requests also wait while no task is expected: every task has finished).
        """
        if kind not in _KINDS:
            raise ConfigError(f"checkpoint request kind must be 'checkpoint' or 'savepoint', got {kind!r}")
        if self._requests or not self._may_trigger_request():
            self._requests.append(kind)
            return None
        return self._trigger(kind, self._clock()).checkpoint_id

    def _may_trigger_request(self) -> bool:
        # With no task left to acknowledge, a checkpoint would hold no state: wait.
        return bool(self._expected) and self.policy.may_trigger_request(len(self._pending))

    def _trigger(self, kind: str, now: float) -> Trigger:
        cid = self._next_id
        self._next_id += 1
        self._pending[cid] = PendingCheckpoint(cid, kind, now, frozenset(self._expected))
        self._last_trigger = now
        action = Trigger(cid, kind, now)
        self._outbox.append(action)
        return action

    def tick(self) -> list[Action]:
        """Time-driven work: emit queued triggers, abort timed-out checkpoints, trigger queued
        requests and due periodic checkpoints."""
        now = self._clock()
        actions: list[Action] = self._outbox  # triggers of requests granted since the last tick
        self._outbox = []
        for p in list(self._pending.values()):
            if p.timed_out(now, self.config.timeout):
                missing = ", ".join(sorted(p.missing)) or "none"
                reason = f"timeout after {now - p.triggered_at:.3g} s (missing acks from {missing})"
                actions += self._fail(p.checkpoint_id, reason, now, counts=True)
        while self._requests and self._may_trigger_request():
            self._trigger(self._requests.popleft(), now)
        if self._expected and not self.defer_periodic and self.policy.may_trigger_periodic(
            now, len(self._pending), self._last_trigger, self._last_end
        ):
            self._trigger(CHECKPOINT, now)
        actions += self._outbox
        self._outbox = []
        return actions

    # ------------------------------------------------------------------ task events
    def on_ack(self, checkpoint_id: int, task: str, payload: Any) -> list[Action]:
        """Task ``task`` acknowledged ``checkpoint_id`` with ``payload`` (opaque: file handles
        etc.). Emits :class:`Commit` when every expected task has acknowledged."""
        p = self._pending.get(checkpoint_id)
        if p is None:
            return []
        now = self._clock()
        if not p.ack(task, payload, now):
            return []
        p.committing = True
        return [Commit(checkpoint_id, dict(p.acks), p.triggered_at, now, p.kind)]

    def on_decline(self, checkpoint_id: int, task: str, reason: str) -> list[Action]:
        """Task ``task`` cannot take checkpoint ``checkpoint_id``: abort it."""
        p = self._pending.get(checkpoint_id)
        if p is None or p.committing:
            return []
        p.declines[task] = reason
        return self._fail(checkpoint_id, f"declined by {task}: {reason}", self._clock(), counts=True)

    def on_task_failed(self, task: str) -> list[Action]:
        """A task failed: every in-flight checkpoint still waiting for acks is aborted.

        (Job failover is the driver's business; these failures do not count towards
        ``tolerable_failures``.)
        """
        now = self._clock()
        actions: list[Action] = []
        for p in list(self._pending.values()):
            if not p.committing:
                actions += self._fail(p.checkpoint_id, f"task failed: {task}", now, counts=False)
        return actions

    def add_tasks(self, tasks: Iterable[str]) -> None:
        """``tasks`` joined (a rescale): checkpoints triggered from now on wait for them too;
        those in flight do not (their barriers were injected before the tasks joined)."""
        self._expected.update(tasks)

    def on_task_finished(self, task: str) -> None:
        """``task`` finished: checkpoints triggered from now on do not wait for it. In-flight
        checkpoints still expect its ack (the runtime acks them as it finishes, or they time
        out)."""
        self._expected.discard(task)

    # ------------------------------------------------------------------ commit results
    def on_committed(self, checkpoint_id: int) -> list[Action]:
        """Manifest ``checkpoint_id`` is durable: emit :class:`NotifyComplete`, and abort older
        in-flight checkpoints (subsumed; savepoints are never subsumed)."""
        p = self._pending.pop(checkpoint_id, None)
        if p is None:
            return []
        now = self._clock()
        self.completed.append(
            CheckpointRecord(checkpoint_id, p.kind, p.triggered_at, now, None, p.acked_at)
        )
        self._last_end = now
        self._consecutive_failures = 0
        actions: list[Action] = []
        for older in [q for q in self._pending.values() if q.checkpoint_id < checkpoint_id]:
            if older.kind == SAVEPOINT or older.committing:
                continue
            reason = f"subsumed by checkpoint {checkpoint_id}"
            actions += self._fail(older.checkpoint_id, reason, now, counts=False)
        if self._latest_notified is None or checkpoint_id > self._latest_notified:
            self._latest_notified = checkpoint_id
            actions.insert(0, NotifyComplete(checkpoint_id))
        return actions

    def on_commit_failed(self, checkpoint_id: int, error: str) -> list[Action]:
        """Writing manifest ``checkpoint_id`` failed: the checkpoint is aborted."""
        if checkpoint_id not in self._pending:
            return []
        return self._fail(checkpoint_id, f"commit failed: {error}", self._clock(), counts=True)

    # ------------------------------------------------------------------ failure
    def _fail(self, checkpoint_id: int, reason: str, now: float, *, counts: bool) -> list[Action]:
        p = self._pending.pop(checkpoint_id)
        self.failed.append(CheckpointRecord(checkpoint_id, p.kind, p.triggered_at, now, reason, p.acked_at))
        self._last_end = now
        actions: list[Action] = [Abort(checkpoint_id, reason)]
        if counts:
            self._consecutive_failures += 1
            limit = self.config.tolerable_failures
            if limit is not None and self._consecutive_failures > limit and not self._job_failed:
                self._job_failed = True
                actions.append(
                    FailJob(
                        f"{self._consecutive_failures} consecutive checkpoint failures exceed "
                        f"tolerable_failures={limit} (last: checkpoint {checkpoint_id}, {reason}); "
                        "fix the cause or raise CheckpointConfig.tolerable_failures"
                    )
                )
        return actions
