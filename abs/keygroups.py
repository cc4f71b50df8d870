"""Key groups, as the runtime imports them: the names of :mod:`abscore.keygroups`.

The stable key hash (specified in :mod:`abscore.hashing`), key groups and their ranges per
subtask live in the floor package ``abscore``, the one implementation that the runtime, the
restore planner (``recovery``) and the offline re-key share. This module only hands those
names on, so that ``from abs.keygroups import key_group`` keeps working; precondition
failures raise :class:`abs.errors.ConfigError` (precisely its subclass
:class:`abscore.errors.ParallelismError`).
"""
from __future__ import annotations

from abscore.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    MAX_MAX_PARALLELISM,
    NONE_HASH,
    TUPLE_SEED,
    KeyGroup,
    KeyGroupRange,
    KeyGroupSet,
    SubtaskIndex,
    check_max_parallelism,
    check_parallelism,
    fmix64,
    key_group,
    key_group_range,
    key_groups,
    routing_table,
    stable_hash,
    stable_hashes,
    subtask_for_key_group,
)

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
