"""Typed ids, so that checkpoint ids, key groups, subtask indexes, operator uids and state
names cannot be mixed up (``typing.NewType``: free at run time, checked by type checkers)."""
from __future__ import annotations

from typing import Iterable, NewType

__all__ = ["CheckpointId", "KeyGroup", "SubtaskIndex", "OperatorUid", "StateName", "id_ranges"]

CheckpointId = NewType("CheckpointId", int)
"""Strictly increasing id of a checkpoint (>= 1), never reused within a root."""

KeyGroup = NewType("KeyGroup", int)
"""Key group index in ``[0, max_parallelism)``."""

SubtaskIndex = NewType("SubtaskIndex", int)
"""Index of a parallel subtask of an operator, ``[0, parallelism)``."""

OperatorUid = NewType("OperatorUid", str)
"""Stable operator id under which state is stored."""

StateName = NewType("StateName", str)
"""Name of a declared keyed state of an operator."""


def id_ranges(ids: Iterable[int], sep: str = ", ") -> str:
    """Ids as runs, for people: ``[40, 41, 42, 44]`` -> ``"40-42, 44"`` (``sep`` between
    runs); ``""`` for none."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(ids)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return sep.join(out)
