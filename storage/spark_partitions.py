"""Spark partitions of a keyed state: contiguous runs of key groups packed by the bytes of
their chains (``keyGroupsPerPartition=auto``); the offline rewrites of :mod:`recovery.rewrite`
pack their tasks the same way. Imports no pyspark."""
from __future__ import annotations

import math
from typing import Sequence

from .file_ref import FileRef

# keyGroupsPerPartition=auto: contiguous key groups are packed by the bytes of their chains.
# A Spark task of a Python data source costs ~50-100 ms of fixed overhead, while one Python
# worker resolves ~50 MiB/s of snapshot files (~5M rows/s of int64 keys + 100-byte strings):
# reading 1M such rows (11 MiB, 128 key groups) took 8-14 s as 128 one-key-group partitions and
# ~1 s as 8 (scripts/bench_spark_read.py). So: partitions of about AUTO_PARTITION_BYTES, but at
# least AUTO_MIN_PARTITIONS of at least AUTO_MIN_PARTITION_BYTES each (parallelism for mid-sized
# states), at most AUTO_MAX_PARTITIONS, never more than the key groups.
AUTO_PARTITION_BYTES = 32 << 20
AUTO_MIN_PARTITION_BYTES = 1 << 20
AUTO_MIN_PARTITIONS = 16
AUTO_MAX_PARTITIONS = 256
_AUTO_KEY_GROUP_COST = 16 << 10  # per key group: file opens, checksums, Arrow set-up (in bytes)


def _chain_bytes(chain: Sequence[FileRef]) -> int:
    return sum(ref.bytes for ref in chain) + _AUTO_KEY_GROUP_COST


def auto_partition_count(total_bytes: int, key_groups: int) -> int:
    """How many partitions ``keyGroupsPerPartition=auto`` aims for (see the constants above)."""
    if key_groups == 0:
        return 0
    wanted = max(math.ceil(total_bytes / AUTO_PARTITION_BYTES),
                 min(AUTO_MIN_PARTITIONS, total_bytes // AUTO_MIN_PARTITION_BYTES))
    return int(max(1, min(wanted, AUTO_MAX_PARTITIONS, key_groups)))


def _pack_by_bytes(chains: list[tuple[int, list[FileRef]]]) -> list[list[tuple[int, list[FileRef]]]]:
    """Contiguous runs of key groups of about equal bytes (a big key group stays alone; the
    share of the others is recomputed after each run)."""
    sizes = [_chain_bytes(chain) for _, chain in chains]
    parts_left = auto_partition_count(sum(sizes), len(chains))
    bytes_left = float(sum(sizes))
    groups: list[list[tuple[int, list[FileRef]]]] = []
    i = 0
    while i < len(chains):
        share = bytes_left / parts_left
        group, filled = [chains[i]], sizes[i]
        i += 1
        while i < len(chains) and (parts_left == 1 or filled + sizes[i] / 2 <= share):
            group.append(chains[i])
            filled += sizes[i]
            i += 1
        groups.append(group)
        bytes_left -= filled
        parts_left = max(1, parts_left - 1)
    return groups
