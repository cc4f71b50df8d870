"""Key groups: which key group a key belongs to, and which key groups a subtask owns.

A keyed stream is partitioned into ``max_parallelism`` (``M``) *key groups*;
``key_group(key) = stable_hash(key) mod M`` with the documented stable hash of
:mod:`abscore.hashing`. Subtask ``i`` of ``P`` owns the contiguous range
``[ceil(i*M/P), floor(((i+1)*M - 1)/P)]`` (Flink's ``KeyGroupRangeAssignment``), in exact
integer arithmetic, so every key group in ``[0, M)`` belongs to exactly one subtask and the
ranges are contiguous and in subtask order; the owner of key group ``kg`` is ``kg * P // M``.
State is stored per key group, so rescaling reassigns whole key groups.

The one implementation of this math: the runtime (``abs``), the restore planner
(``recovery``) and the offline re-key all use it. Every precondition fails with
:class:`abscore.errors.ParallelismError` (a ``ConfigError`` and a ``ValueError``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from .errors import ParallelismError
from .hashing import NONE_HASH, TUPLE_SEED, fmix64, stable_hash, stable_hashes
from .ids import KeyGroup, SubtaskIndex, id_ranges

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "MAX_MAX_PARALLELISM",
    "KeyGroup",
    "SubtaskIndex",
    "NONE_HASH",
    "TUPLE_SEED",
    "fmix64",
    "stable_hash",
    "stable_hashes",
    "key_group",
    "key_groups",
    "KeyGroupRange",
    "KeyGroupSet",
    "key_group_range",
    "subtask_for_key_group",
    "routing_table",
    "check_max_parallelism",
    "check_parallelism",
]

DEFAULT_MAX_PARALLELISM = 128
"""Number of key groups of a job unless configured otherwise (fixed for the job's life)."""

MAX_MAX_PARALLELISM = 32768
"""Largest supported ``max_parallelism`` (as in Flink: 2**15)."""


def check_max_parallelism(max_parallelism: int) -> None:
    """Raise :class:`ParallelismError` unless ``1 <= max_parallelism <= 32768``."""
    if (
        type(max_parallelism) is not int
        or not 1 <= max_parallelism <= MAX_MAX_PARALLELISM
    ):
        raise ParallelismError(
            f"Maximum parallelism must be an int between 1 and {MAX_MAX_PARALLELISM}. "
            f"Found: {max_parallelism!r}. Choose a max_parallelism in that range."
        )


def check_parallelism(max_parallelism: int, parallelism: int) -> None:
    """Raise :class:`ParallelismError` unless ``1 <= parallelism <= max_parallelism <= 32768``."""
    check_max_parallelism(max_parallelism)
    if type(parallelism) is not int or parallelism < 1:
        raise ParallelismError(
            f"Parallelism must be a positive int. Found: {parallelism!r}. "
            "Use a parallelism of at least 1."
        )
    if parallelism > max_parallelism:
        raise ParallelismError(
            f"Maximum parallelism ({max_parallelism}) must not be smaller than parallelism "
            f"({parallelism}). Lower the parallelism, or re-key the job into a larger "
            "max_parallelism with the offline re-key tool."
        )


def key_group(key: Any, max_parallelism: int) -> int:
    """Key group of ``key``: ``stable_hash(key) % max_parallelism``.

    ``max_parallelism`` is not validated here (this is a per-record function); validate it once
    with :func:`check_max_parallelism`.
    """
    return stable_hash(key) % max_parallelism


def key_groups(keys: Any, max_parallelism: int) -> np.ndarray:
    """Key group of every key as a ``numpy.int32`` array; equal to :func:`key_group` per key.

    Accepts what :func:`abscore.hashing.stable_hashes` accepts.
    """
    check_max_parallelism(max_parallelism)
    hashes = stable_hashes(keys)
    if max_parallelism & (max_parallelism - 1) == 0:  # a power of two: the remainder is a mask (~10x cheaper)
        return (hashes & np.uint64(max_parallelism - 1)).astype(np.int32)
    return (hashes % np.uint64(max_parallelism)).astype(np.int32)


@dataclass(frozen=True)
class KeyGroupRange:
    """Inclusive range ``[start, end]`` of key groups; empty when ``end == start - 1``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start - 1:
            raise ParallelismError(
                f"KeyGroupRange(start={self.start}, end={self.end}) is invalid: need "
                "0 <= start and end >= start - 1; fix the range bounds"
            )

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]" if len(self) else "[]"


class KeyGroupSet:
    """The key groups one subtask owns while a job runs: a range at start, any set once live
    reconfiguration moved key groups in or out (``abs.reconfig``). Reads like
    :class:`KeyGroupRange` (``in``, iteration in ascending order, ``len``, ``start``/``end``:
    the lowest and highest owned) and keeps a boolean mask for vectorised membership tests.
    Mutated only by the subtask's own thread (:meth:`add`, :meth:`discard`)."""

    __slots__ = ("max_parallelism", "mask", "_sorted")

    def __init__(self, max_parallelism: int, key_groups: Iterable[int] = ()) -> None:
        self.max_parallelism = max_parallelism
        self.mask = np.zeros(max_parallelism, dtype=bool)
        for kg in key_groups:
            self._check(kg)
            self.mask[kg] = True
        self._sorted: tuple[int, ...] | None = None

    @classmethod
    def of(cls, max_parallelism: int, owned: "KeyGroupRange | KeyGroupSet | Iterable[int]") -> "KeyGroupSet":
        """``owned`` itself when it is a set of the same key space (so that two views of one
        subtask's state share one ownership), else a new set of its key groups."""
        if isinstance(owned, KeyGroupSet) and owned.max_parallelism == max_parallelism:
            return owned
        return cls(max_parallelism, owned)

    def _check(self, kg: object) -> None:
        if type(kg) is not int or not 0 <= kg < self.max_parallelism:
            raise ParallelismError(
                f"key group {kg!r} is out of range for max parallelism {self.max_parallelism}; "
                f"key groups are in [0, {self.max_parallelism - 1}]"
            )

    def add(self, kg: int) -> None:
        self._check(kg)
        self.mask[kg] = True
        self._sorted = None

    def discard(self, kg: int) -> None:
        self._check(kg)
        self.mask[kg] = False
        self._sorted = None

    def _groups(self) -> tuple[int, ...]:
        if self._sorted is None:
            self._sorted = tuple(np.flatnonzero(self.mask).tolist())
        return self._sorted

    def __contains__(self, kg: object) -> bool:
        return isinstance(kg, int) and 0 <= kg < self.max_parallelism and bool(self.mask[kg])

    def __iter__(self) -> Iterator[int]:
        return iter(self._groups())

    def __len__(self) -> int:
        return len(self._groups())

    @property
    def start(self) -> int:
        g = self._groups()
        return g[0] if g else 0

    @property
    def end(self) -> int:
        g = self._groups()
        return g[-1] if g else -1

    def __eq__(self, other: object) -> bool:
        """Equal to a set or range holding the same key groups."""
        if isinstance(other, (KeyGroupSet, KeyGroupRange)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __str__(self) -> str:
        g = self._groups()
        return "{" + id_ranges(g, sep=",") + "}" if g else "[]"

    __repr__ = __str__


def key_group_range(max_parallelism: int, parallelism: int, subtask: int) -> KeyGroupRange:
    """Key groups owned by subtask ``subtask`` of ``parallelism`` (Flink's formula).

    ``start = ceil(i*M/P)``, ``end = floor(((i+1)*M - 1)/P)``, in exact integer arithmetic.
    """
    check_parallelism(max_parallelism, parallelism)
    if type(subtask) is not int or not 0 <= subtask < parallelism:
        raise ParallelismError(
            f"Subtask index {subtask!r} is out of range for parallelism {parallelism}; "
            f"use an index in [0, {parallelism - 1}]."
        )
    start = (subtask * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """Subtask that owns ``key_group``: ``key_group * P // M`` (inverse of the ranges)."""
    check_parallelism(max_parallelism, parallelism)
    if type(key_group) is not int or not 0 <= key_group < max_parallelism:
        raise ParallelismError(
            f"Key group {key_group!r} is out of range for max parallelism {max_parallelism}; "
            f"key groups are in [0, {max_parallelism - 1}]."
        )
    return key_group * parallelism // max_parallelism


def routing_table(max_parallelism: int, parallelism: int) -> tuple[int, ...]:
    """``table[kg]`` = subtask owning key group ``kg``, for every ``kg`` in ``[0, M)``.

    This is the initial routing of ``key_by`` exchanges (contiguous ranges); the runtime keeps
    it as a table so that key groups can later be moved individually.
    """
    check_parallelism(max_parallelism, parallelism)
    p, m = parallelism, max_parallelism
    return tuple(kg * p // m for kg in range(m))
