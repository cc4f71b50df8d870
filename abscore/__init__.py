"""The floor under ``abs``, ``storage`` and ``recovery``: what all three agree on.

- :mod:`abscore.keygroups` (with :mod:`abscore.hashing`): the stable key hash, key groups and
  their ranges per parallelism: the one implementation of the key-group math;
- :mod:`abscore.ids`: typed ids (checkpoint id, key group, subtask index, operator uid,
  state name);
- :mod:`abscore.schema`: the names and values of the state-file schema;
- :mod:`abscore.logs`: the loggers of ``abs``, ``storage`` and ``recovery`` and their default
  stderr handler;
- :mod:`abscore.errors`: the one error root, :class:`AbsError` (re-exported as
  ``abs.AbsError``; ``storage.StorageError`` and ``recovery.RecoveryError`` derive from it).

Layers, each importing only those below it: ``abscore`` <- ``storage`` <- ``recovery`` <-
``abs``. This package imports none of the others.
"""
from __future__ import annotations

from .errors import AbsError, ConfigError, ParallelismError

__all__ = ["AbsError", "ConfigError", "ParallelismError"]
