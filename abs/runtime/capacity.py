"""The driver's part in running on the slots there are (``RestartStrategy.min_workers``).

A restart after a lost Spark executor or host first asks the executor how many of the job's
workers can start (``available_workers``: it waits ``SparkExecutor.slot_wait`` for all of
them). Fewer, but at least ``min_workers``: the attempt runs with that many, restoring the
checkpoint into the smaller parallelism as a restore into another parallelism does (each
worker reads its key groups' chains; sources' splits spread over the workers there are).
Fewer than ``min_workers``: the restart goes ahead at the job's parallelism and the executor's
launch fails naming the free and needed slots, as without the option.

While an attempt runs below the parallelism the job wants (``wanted_workers``: the
parallelism it started with, or the last one a user's live rescale asked for), the driver
looks every ``CAPACITY_CHECK_S`` for the missing slots (``check_launch``) and, once they are
free, rescales the job back live (``all_at_once``: the missing workers join, key groups move
to them from the checkpointed state). Not when an :class:`abs.Autoscale` decides the
parallelism, nor for jobs that cannot be reconfigured live (loops, unaligned checkpoints):
those stay at the smaller parallelism until their next restart, which asks again.
"""
from __future__ import annotations

import logging
import queue
from typing import Any

from . import messages as m

log = logging.getLogger(__name__)

__all__ = ["Capacity", "CAPACITY_CHECK_S"]

CAPACITY_CHECK_S = 2.0  # how often a job below its parallelism looks for the missing slots


class Capacity:
    """Mixin of the job driver (see the module docstring)."""

    def _capacity_init(self) -> None:
        self.wanted_workers = self.P
        self._capacity_checked = 0.0
        self._capacity_reply: "queue.Queue[Any] | None" = None  # the rescale back, while it runs

    def _capacity_attempt(self, attempt: int) -> None:
        """At each attempt's start (a rescale back of the attempt before ended with it)."""
        self._capacity_reply = None
        self._capacity_checked = self.clock()
        if attempt > 0:
            self._fit_to_slots()

    def _fit_to_slots(self) -> None:
        """Before a restarted attempt: as many workers as the executor has slots for, down to
        ``min_workers``, up to what the job wants."""
        minimum = self.restart.min_workers
        available = getattr(self.executor, "available_workers", None)
        if minimum is None or available is None:
            return
        wanted = self.wanted_workers
        can, slots = available(wanted)
        if can < minimum:
            log.warning(f"job {self.flow.name!r}: {slots}; the restart needs at least {minimum} "
                        f"(RestartStrategy.min_workers) of its {wanted} workers")
            workers = wanted  # the launch fails naming the numbers, as without the option
        else:
            workers = can
        if workers < wanted:
            log.warning(f"job {self.flow.name!r}: {slots}: restarting with {workers} of its {wanted} workers "
                        f"(RestartStrategy.min_workers={minimum}); it rescales back once the slots are free")
        if workers != self.P:
            self._resize(workers)
        if self.restarts:
            self.restarts[-1]["workers"] = self.P

    def _capacity_tick(self, run: Any) -> None:
        """Every round of the driver's loop: a job below its parallelism rescales back once
        the executor has the slots."""
        if self._capacity_reply is not None:
            try:
                got = self._capacity_reply.get_nowait()
            except queue.Empty:
                return
            self._capacity_reply = None
            if isinstance(got, BaseException):
                log.warning(f"job {self.flow.name!r}: rescaling back to {self.wanted_workers} workers failed: {got}")
            return
        if (self.P >= self.wanted_workers or self.restart.min_workers is None or self.autoscale is not None
                or self._reconf is not None or run.life.sources_exhausted
                or self.flow.has_loops or self.config.priority_barriers):
            return
        now = self.clock()
        if now - self._capacity_checked < CAPACITY_CHECK_S:
            return
        self._capacity_checked = now
        check = getattr(self.executor, "check_launch", None)
        if check is None or check(self.wanted_workers - self.P) is not None:
            return
        log.info(f"[abs] job {self.flow.name!r}: the slots are back: rescaling from {self.P} to "
                 f"{self.wanted_workers} workers")
        self._capacity_reply = queue.Queue()
        self._serve_reconfig(run, m.ReconfigRequest("rescale", (self.wanted_workers,), "all_at_once", None,
                                                     self._capacity_reply))
