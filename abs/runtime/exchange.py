"""The sending side of an exchange edge: a task's output partitioned over the channels to the
next task's subtasks (forward, key_by through the routing table, rebalance, broadcast), and
the elements every channel gets in order: barriers (announced ahead of the queued records
for unaligned checkpoints), cancel markers, reconfiguration step markers, end of stream.

A source's key_by writer *coalesces* (:meth:`ExchangeWriter.enable_coalescing`): partitioning a batch over ``p``
channels leaves slices of ``1/p`` of its rows, and every element a channel carries costs the
same whatever its size (a frame, a gate entry and a wake-up of the receiving thread, and the
receiving operator's per-batch work). Slices of fewer than :data:`COALESCE_ROWS` rows are held
per channel and go as one batch once they reach it; whatever is held goes out before any other
element on any channel (barrier, announcement, cancel or step marker, end of stream), so no
record changes sides of a barrier or marker; and before the source task waits (no input now),
or once the oldest held slice is :data:`COALESCE_S` old, so a slow source's records are not
delayed beyond that. Not for loops (their quiescence counts what is in flight).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from abscore.native import NATIVE

from ..dataflow import BROADCAST, FORWARD, KEY_BY, REBALANCE
from .channels import EOS, Barrier, StepMarker
from .operators import KeyExtractor
from .plan import OutputPlan

__all__ = ["ExchangeWriter", "COALESCE_ROWS", "COALESCE_S"]

COALESCE_ROWS = 16_384
"""A coalescing writer sends a channel's held slices once they hold this many rows (see the
module docstring). Reference jobs at p=2 (100 k string keys, 8,192-row source batches, so
~4,096-row slices), 3 interleaved rounds at load ~5, CPU of the workers per event with / without:
``aggregate`` 181-205 / 229-253 ns (end-to-end 6.4-8.5 / 4.4-5.5 M events/s); ``process``
991-1,141 / 1,016-1,154 ns (its per-record Python dwarfs the per-batch costs). 16,384 rather
than 8,192 (with the C loops of :mod:`abscore.native`, 2 M events, 4 interleaved pairs):
``aggregate`` processing 13.9-16.6 against 11.5-14.2 M events/s, CPU 192-230 against 205-267 ns
an event."""

COALESCE_S = 0.01
"""The longest a coalescing writer holds a slice while its task keeps emitting (seconds)."""


class ExchangeWriter:
    """Partitions a task's output over the channels of one exchange edge."""

    def __init__(self, out: OutputPlan, senders: list, routing: np.ndarray, max_parallelism: int, uid: str,
                 joining: "list | None" = None) -> None:
        self.partition = out.partition
        self.senders = senders
        # rescale: senders to workers that join at the next join step (filled by the worker
        # before the step starts), and how many of the senders get records (a drain stops
        # records to the leaving workers; their channels still carry barriers until retired)
        self.joining = joining if joining is not None else []
        self.active = len(senders)
        # this writer's own: switched at its step markers; int16 (a subtask index is below
        # max_parallelism <= 32768): what the C partition takes, and without it the stable
        # argsort that groups a batch's rows by channel is numpy's radix sort (8,192 rows ~2.5x
        # faster than int64's merge sort)
        self.routing = np.array(routing, dtype=np.int16)
        self.extractor = KeyExtractor(uid, out.key, max_parallelism) if out.partition == KEY_BY else None
        self._rr = 0
        self.coalesce = False  # see enable_coalescing
        self.held: dict[int, list[pa.RecordBatch]] = {}  # channel -> slices held (coalesce)
        self._held_rows: dict[int, int] = {}
        self._held_since = 0.0  # when the oldest slice held now was held

    def __call__(self, batch: pa.RecordBatch) -> None:
        senders = self.senders
        if self.partition == FORWARD or self.active == 1:
            if self.held:
                self.flush()
            senders[0].send(batch)
        elif self.partition == KEY_BY:
            kgs = self.extractor.key_groups(batch)
            if NATIVE is not None:  # routing, counts and the stable grouping in one C pass
                order = np.empty(len(kgs), np.int64)
                counts = np.empty(len(senders), np.int64)
                NATIVE.partition(np.ascontiguousarray(kgs, np.int32), self.routing, order, counts)
            else:
                sub = self.routing[kgs]
                counts = np.bincount(sub, minlength=len(senders))
                order = None
            if counts.max() == batch.num_rows:
                self._send(int(counts.argmax()), batch)
            else:
                if order is None:
                    order = np.argsort(sub, kind="stable")
                shuffled = batch.take(pa.array(order))
                start = 0
                for s, c in enumerate(counts.tolist()):
                    if c:
                        self._send(s, shuffled.slice(start, c))
                    start += c
            if self.held and time.monotonic() - self._held_since >= COALESCE_S:
                self.flush()
        elif self.partition == REBALANCE:
            senders[self._rr % self.active].send(batch)
            self._rr += 1
        elif self.partition == BROADCAST:
            for s in senders[:self.active]:
                s.send(batch)

    def enable_coalescing(self) -> None:
        """Hold small key_by slices per channel (a source task's writers; module docstring)."""
        self.coalesce = self.partition == KEY_BY

    def _send(self, channel: int, part: pa.RecordBatch) -> None:
        """Send ``part`` to ``channel``, or hold it there (coalescing, see the module docstring)."""
        if not self.coalesce:
            self.senders[channel].send(part)
            return
        held = self.held.get(channel)
        if held is None:
            if part.num_rows >= COALESCE_ROWS:
                self.senders[channel].send(part)
                return
            if not self.held:
                self._held_since = time.monotonic()
            self.held[channel] = [part]
            self._held_rows[channel] = part.num_rows
            return
        if not part.schema.equals(held[0].schema):  # a batch of another schema: what is held goes first
            self._release(channel)
            self._send(channel, part)
            return
        held.append(part)
        self._held_rows[channel] += part.num_rows
        if self._held_rows[channel] >= COALESCE_ROWS:
            self._release(channel)

    def _release(self, channel: int) -> None:
        parts = self.held.pop(channel)
        del self._held_rows[channel]
        self.senders[channel].send(parts[0] if len(parts) == 1 else pa.concat_batches(parts))

    def flush(self) -> None:
        """Send every held slice (before any other element, and when the task goes idle)."""
        for channel in sorted(self.held):
            self._release(channel)

    def send_all(self, item: Any) -> None:
        if self.held:
            self.flush()
        for s in self.senders:
            s.send(item)

    def announce(self, barrier: Barrier) -> None:
        """Announce ``barrier`` ahead of the queued records on every channel (unaligned
        checkpoints); it is sent in order too, with :meth:`send_all`."""
        if self.held:
            self.flush()  # the held records are before the barrier: sent, so that it counts them
        for s in self.senders:
            s.announce(barrier)

    def switch(self, marker: StepMarker) -> None:
        """Emit step ``marker`` on every channel, then route its key groups to their new
        owners: every record this writer sent before goes to the old owner, every later one
        to the new owner (one thread emits records and markers, so nothing comes between).
        A rescale's marker also changes the senders: a join adds the channels to the new
        workers (whose first element is this marker), a drain stops records to the leaving
        workers, a retire ends the channels to them."""
        self.send_all(marker)  # held slices first: they were routed before the marker
        if marker.workers and self.partition != FORWARD:
            if marker.phase == "join" and len(self.senders) < marker.workers:
                new, self.joining[:] = list(self.joining), []
                if len(self.senders) + len(new) != marker.workers:
                    raise RuntimeError(f"join of {marker.workers} workers with {len(self.senders)} + {len(new)} "
                                       "channels (a runtime bug)")
                for s in new:
                    s.send(marker)
                self.senders.extend(new)
            elif marker.phase == "retire":
                for s in self.senders[marker.workers:]:
                    s.send(EOS)
                    s.close()
                del self.senders[marker.workers:]
            self.active = min(len(self.senders), marker.workers)
        for kg, target in marker.moves:
            self.routing[kg] = target
