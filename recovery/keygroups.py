"""Key-group ranges: which key groups subtask ``i`` of ``P`` owns (Flink's formula).

``recovery`` does not import ``abs``; these few lines restate the formula of
``abs.keygroups.key_group_range`` (tests check that both agree for every ``M``, ``P``, ``i``):

    start(i) = ceil(i * M / P)
    end(i)   = floor(((i + 1) * M - 1) / P)

in exact integer arithmetic. Every key group in ``[0, M)`` belongs to exactly one subtask,
and ranges are contiguous and in subtask order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .errors import ParallelismError

__all__ = ["KeyGroupRange", "key_group_range", "subtask_for_key_group", "routing_table", "check_parallelism"]


@dataclass(frozen=True)
class KeyGroupRange:
    """Inclusive range ``[start, end]`` of key groups; empty when ``end == start - 1``."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]" if len(self) else "[]"


def check_parallelism(max_parallelism: int, parallelism: int) -> None:
    """Raise :class:`ParallelismError` unless ``1 <= parallelism <= max_parallelism``."""
    if type(max_parallelism) is not int or max_parallelism < 1:
        raise ParallelismError(f"max_parallelism {max_parallelism!r} is invalid; use an integer >= 1")
    if type(parallelism) is not int or parallelism < 1:
        raise ParallelismError(f"parallelism {parallelism!r} is invalid; use an integer >= 1")
    if parallelism > max_parallelism:
        raise ParallelismError(
            f"parallelism {parallelism} exceeds max_parallelism {max_parallelism} (the number of key groups); "
            "lower the parallelism, or re-key the snapshot offline into a larger max_parallelism"
        )


def key_group_range(max_parallelism: int, parallelism: int, subtask: int) -> KeyGroupRange:
    """Key groups owned by ``subtask`` of ``parallelism``: ``[ceil(i*M/P), floor(((i+1)*M-1)/P)]``."""
    check_parallelism(max_parallelism, parallelism)
    if type(subtask) is not int or not 0 <= subtask < parallelism:
        raise ParallelismError(
            f"subtask {subtask!r} is out of range for parallelism {parallelism}; use an index in [0, {parallelism - 1}]"
        )
    m, p = max_parallelism, parallelism
    return KeyGroupRange((subtask * m + p - 1) // p, ((subtask + 1) * m - 1) // p)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask whose range holds ``key_group``: ``key_group * P // M``."""
    check_parallelism(max_parallelism, parallelism)
    if type(key_group) is not int or not 0 <= key_group < max_parallelism:
        raise ParallelismError(
            f"key group {key_group!r} is out of range for max_parallelism {max_parallelism}; "
            f"key groups are in [0, {max_parallelism - 1}]"
        )
    return key_group * parallelism // max_parallelism


def routing_table(max_parallelism: int, parallelism: int) -> tuple[int, ...]:
    """``table[kg]`` = the subtask owning key group ``kg``, for every ``kg`` in ``[0, M)``."""
    check_parallelism(max_parallelism, parallelism)
    return tuple(kg * parallelism // max_parallelism for kg in range(max_parallelism))
