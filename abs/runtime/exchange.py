"""The sending side of an exchange edge: a task's output partitioned over the channels to the
next task's subtasks (forward, key_by through the routing table, rebalance, broadcast), and
the elements every channel gets in order: barriers (announced ahead of the queued records
for unaligned checkpoints), cancel markers, reconfiguration step markers, end of stream."""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..dataflow import BROADCAST, FORWARD, KEY_BY, REBALANCE
from .channels import EOS, Barrier, StepMarker
from .operators import KeyExtractor
from .plan import OutputPlan

__all__ = ["ExchangeWriter"]


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
        self.routing = np.array(routing, dtype=np.int64)  # this writer's own: switched at its step markers
        self.extractor = KeyExtractor(uid, out.key, max_parallelism) if out.partition == KEY_BY else None
        self._rr = 0

    def __call__(self, batch: pa.RecordBatch) -> None:
        senders = self.senders
        if self.partition == FORWARD or self.active == 1:
            senders[0].send(batch)
        elif self.partition == KEY_BY:
            sub = self.routing[self.extractor.key_groups(batch)]
            order = np.argsort(sub, kind="stable")
            counts = np.bincount(sub, minlength=len(senders))
            if counts.max() == batch.num_rows:
                senders[int(sub[0])].send(batch)
                return
            shuffled = batch.take(pa.array(order))
            start = 0
            for s, c in enumerate(counts.tolist()):
                if c:
                    senders[s].send(shuffled.slice(start, c))
                start += c
        elif self.partition == REBALANCE:
            senders[self._rr % self.active].send(batch)
            self._rr += 1
        elif self.partition == BROADCAST:
            for s in senders[:self.active]:
                s.send(batch)

    def send_all(self, item: Any) -> None:
        for s in self.senders:
            s.send(item)

    def announce(self, barrier: Barrier) -> None:
        """Announce ``barrier`` ahead of the queued records on every channel (unaligned
        checkpoints); it is sent in order too, with :meth:`send_all`."""
        for s in self.senders:
            s.announce(barrier)

    def switch(self, marker: StepMarker) -> None:
        """Emit step ``marker`` on every channel, then route its key groups to their new
        owners: every record this writer sent before goes to the old owner, every later one
        to the new owner (one thread emits records and markers, so nothing comes between).
        A rescale's marker also changes the senders: a join adds the channels to the new
        workers (whose first element is this marker), a drain stops records to the leaving
        workers, a retire ends the channels to them."""
        self.send_all(marker)
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
