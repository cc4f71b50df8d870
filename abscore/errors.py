"""The one error root of the toolkit, and the errors of the floor itself.

Every error that ``abs``, ``storage`` and ``recovery`` raise on purpose derives from
:class:`AbsError` (``storage.StorageError`` and ``recovery.RecoveryError`` are subclasses), so
``except abs.AbsError`` catches all of them. Each class also derives from a built-in exception
where one fits (``ValueError``, ``OSError``, ``LookupError`` ...), so ``except ValueError``
keeps working. Every class states its cause and its remedy; messages name the object and end
with a verdict and an action.

This module imports nothing of the project: it is the floor under every package.
"""
from __future__ import annotations

__all__ = ["AbsError", "ConfigError", "ParallelismError"]


class AbsError(Exception):
    """Root of every error this toolkit raises on purpose (runtime, storage and recovery)."""


class ConfigError(AbsError, ValueError):
    """An option passed to ``abs.run`` / ``abs.submit`` or a config object is invalid.

    Remedy: the message names the option and the allowed values.
    """


class ParallelismError(ConfigError):
    """A parallelism, ``max_parallelism``, subtask index or key group is out of range (the
    one error of the key-group math in :mod:`abscore.keygroups`).

    Remedy: use ``1 <= parallelism <= max_parallelism <= 32768``, a subtask index in
    ``[0, parallelism)`` and a key group in ``[0, max_parallelism)``; ``max_parallelism`` of an
    existing snapshot changes only through the offline re-key.
    """
