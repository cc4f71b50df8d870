"""Records held at a key group's new owner until its state is installed.

From the moment a task aligns the step that gives it key group ``kg`` until ``kg``'s state
arrives, its rows are held here in arrival order; the rows of other key groups go on. At
install the held rows of ``kg`` come out in the order they came in, before any later row of
``kg`` (the task processes them at once, in its own thread), so per-key order is kept.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["Holding"]


class Holding:
    def __init__(self, max_parallelism: int) -> None:
        self.mask = np.zeros(max_parallelism, dtype=bool)
        self.waiting: set[int] = set()
        self._held: list[tuple[pa.RecordBatch, np.ndarray]] = []  # (rows, their key groups)

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def hold(self, kg: int) -> None:
        self.mask[kg] = True
        self.waiting.add(kg)

    @property
    def rows(self) -> int:
        return sum(b.num_rows for b, _ in self._held)

    def split(self, batch: pa.RecordBatch, kgs: np.ndarray) -> pa.RecordBatch | None:
        """Keep the rows of waiting key groups; return the others (None when none is left)."""
        held = self.mask[kgs]
        if not held.any():
            return batch
        if held.all():
            self._held.append((batch, kgs))
            return None
        self._held.append((batch.filter(pa.array(held)), kgs[held]))
        return batch.filter(pa.array(~held))

    def release(self, kg: int) -> list[pa.RecordBatch]:
        """The held rows of ``kg`` in arrival order; ``kg`` is no longer waited for."""
        self.mask[kg] = False
        self.waiting.discard(kg)
        out: list[pa.RecordBatch] = []
        kept: list[tuple[pa.RecordBatch, np.ndarray]] = []
        for batch, kgs in self._held:
            mine = kgs == kg
            if not mine.any():
                kept.append((batch, kgs))
            elif mine.all():
                out.append(batch)
            else:
                out.append(batch.filter(pa.array(mine)))
                kept.append((batch.filter(pa.array(~mine)), kgs[~mine]))
        self._held = kept
        return out
