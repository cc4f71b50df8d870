"""Typed ids, so that checkpoint ids, key groups, subtask indexes, operator uids and state
names cannot be mixed up (``typing.NewType``: free at run time, checked by type checkers)."""
from __future__ import annotations

from typing import NewType

__all__ = ["CheckpointId", "KeyGroup", "SubtaskIndex", "OperatorUid", "StateName"]

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
