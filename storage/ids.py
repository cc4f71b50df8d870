"""Typed ids (checkpoint id, key group, subtask index, operator uid, state name): defined in
the floor package :mod:`abscore.ids` and handed on here for the storage layer."""
from __future__ import annotations

from abscore.ids import CheckpointId, KeyGroup, OperatorUid, StateName, SubtaskIndex

__all__ = ["CheckpointId", "KeyGroup", "SubtaskIndex", "OperatorUid", "StateName"]
