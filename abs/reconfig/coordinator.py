"""The driver's side of one reconfiguration (pure: an injected clock, no I/O).

A reconfiguration is a tuple of :class:`~abs.reconfig.plan.Step` values run one after the
other: step ``k + 1`` starts once every key group of step ``k`` is installed at its new owner
in every keyed operator (for ``fluid``, one key group at a time). The driver asks
:meth:`Reconfiguration.start_next` for the step to inject, reports each handover and each
install, and reads the record (:meth:`Reconfiguration.record`) that
``JobHandle.reconfigurations()`` lists.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from .plan import Assignment, ReconfigurationError, Step

__all__ = ["Reconfiguration", "StepRecord", "ReconfigurationRecord"]


@dataclasses.dataclass
class StepRecord:
    step: int  # the job-wide step id (StepMarker.step)
    key_groups: tuple[int, ...]
    started: float
    finished: float | None = None
    bytes_moved: int = 0  # handed over on the channel (the changes, or the whole state)
    bytes_read: int = 0  # read from storage at install (0 when preloaded)
    full_bytes: int = 0  # the moved key groups' size in the checkpoint they build on
    full_handovers: int = 0  # key groups sent whole (no checkpoint to build on)

    @property
    def duration(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


@dataclasses.dataclass
class ReconfigurationRecord:
    """What ``JobHandle.reconfigurations()`` lists for one reconfiguration."""

    id: int
    kind: str
    strategy: str
    before: str  # Assignment.describe()
    after: str
    steps: list[StepRecord]
    started: float
    finished: float | None = None
    status: str = "RUNNING"  # RUNNING, COMPLETED, FAILED
    error: str | None = None

    @property
    def key_groups(self) -> tuple[int, ...]:
        return tuple(kg for s in self.steps for kg in s.key_groups)

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved for s in self.steps)

    @property
    def duration(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


class Reconfiguration:
    """One reconfiguration in progress (see the module docstring)."""

    def __init__(self, rid: int, kind: str, strategy: str, current: Assignment, target: Assignment,
                 steps: Sequence[Step], keyed_operators: Sequence[str], first_step_id: int,
                 clock: Callable[[], float]) -> None:
        if not steps:
            raise ReconfigurationError("nothing to move: every key group is already where it was asked to be")
        self.clock = clock
        self.assignment = current
        self.target = target
        self.steps = list(steps)
        self.operators = tuple(keyed_operators)
        self._next = 0
        self._step_id = first_step_id
        self._waiting: set[tuple[str, int]] = set()  # (operator, key group) not installed yet
        self.current: Step | None = None
        self.record = ReconfigurationRecord(rid, kind, strategy, current.describe(), target.describe(), [],
                                            clock())

    @property
    def done(self) -> bool:
        return self.current is None and self._next >= len(self.steps)

    def start_next(self) -> tuple[int, Step] | None:
        """The next step to inject (its job-wide id and moves), or None when all are done."""
        if self.current is not None:
            raise RuntimeError(f"step {self.current.index} still runs")
        if self._next >= len(self.steps):
            return None
        step = self.steps[self._next]
        self._next += 1
        self.current = step
        self._waiting = {(op, mv.key_group) for op in self.operators for mv in step.moves}
        sid = self._step_id
        self._step_id += 1
        self.record.steps.append(StepRecord(sid, step.key_groups, self.clock()))
        return sid, step

    def on_handover(self, nbytes: int, full: bool) -> None:
        rec = self.record.steps[-1]
        rec.bytes_moved += nbytes
        rec.full_handovers += int(full)

    def on_full_size(self, nbytes: int) -> None:
        self.record.steps[-1].full_bytes += nbytes

    def on_installed(self, operator: str, kg: int, read_bytes: int) -> bool:
        """True when this completes the current step (its moves then count in
        :attr:`assignment`)."""
        if self.current is None or (operator, kg) not in self._waiting:
            raise RuntimeError(f"install of key group {kg} of {operator!r} that no running step moves")
        self.record.steps[-1].bytes_read += read_bytes
        return self.on_event((operator, kg))

    def expect(self, *events: object) -> None:
        """The current step also waits for ``events`` (a rescale's: source splits handed over,
        a checkpoint, leaving workers stopped), each reported by :meth:`on_event`."""
        self._waiting.update(events)

    def waits_for(self, event: object) -> bool:
        return event in self._waiting

    def waits_for_any(self, kind: str) -> bool:
        """The current step still waits for an event ``(kind, ...)``."""
        return bool(self.pending(kind))

    def pending(self, kind: str) -> list:
        """The events ``(kind, ...)`` the current step still waits for."""
        return [e for e in self._waiting if isinstance(e, tuple) and e[0] == kind]

    def on_event(self, event: object) -> bool:
        """``event`` the current step waited for happened; True when that completes the step."""
        self._waiting.discard(event)
        if self._waiting or self.current is None:
            return False
        self._complete()
        return True

    def complete_idle(self) -> bool:
        """The current step waits for nothing (:attr:`idle`: no event will complete it, e.g. a
        drain step of workers that read no split, when the job does not checkpoint): it is
        complete now; True then."""
        if not self.idle:
            return False
        self._complete()
        return True

    def _complete(self) -> None:
        """The current step is complete: its moves count in :attr:`assignment`."""
        self.assignment = self.assignment.applied(self.current.moves)
        if self.current.phase == "retire":  # the leaving workers are gone
            self.assignment = self.assignment.widened(self.current.workers)
        self.record.steps[-1].finished = self.clock()
        self.current = None
        if self._next >= len(self.steps):
            self.record.finished = self.clock()
            self.record.status = "COMPLETED"

    @property
    def idle(self) -> bool:
        """The current step waits for nothing (e.g. a join without key groups to move)."""
        return self.current is not None and not self._waiting

    def fail(self, error: str) -> None:
        self.record.status = "FAILED"
        self.record.error = error
        self.record.finished = self.clock()
